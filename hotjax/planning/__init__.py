"""Planning: choosing the strategy table a run trains under.

- `search`: the strategy search (`hotjax plan`, `--strategies auto`), a dynamic program over
  bucket boundaries and strategies priced by the cost model.
- `cost`: the cost model's time: a micro-step's seconds under a strategy, from a profile.
- `memory`: the cost model's memory: a micro-step's per-device peak, as XLA plans it.
- `shares`: one device's part of a micro-step under a strategy, which both price.
- `profile`: hardware profiles (shipped ones in `profiles/`, or measured) and their TOML form.
- `measure`: measuring this machine's profile, and caching it per cost-model version.
- `wall`: XLA's memory analysis for planning (a declared memory wall, a plan checked).

The `hotjax plan` command and its report are `hotjax.commands.plan`.

Moving parameters between strategies at run time is not planning but switching
(`hotjax.sharding.transfers`).
"""

"""Planning: choosing the strategy table a run trains under.

- `search`: the strategy search (`hotjax plan`, `--strategies auto`), a dynamic program over
  bucket boundaries and strategies priced by the cost model.
- `cost`: the cost model: a micro-step's time and memory under a strategy, from a profile.
- `profile`: hardware profiles (shipped ones in `profiles/`, or measured) and their TOML form.
- `measure`: measuring this machine's profile, and caching it per cost-model version.
- `cli`: the `hotjax plan` command.

Moving parameters between strategies at run time is not planning but switching
(`hotjax.sharding.transfers`).
"""

"""What a training run is asked to do: the options of `hotjax train`, as one frozen record.

Free of JAX imports, so the command line can read its defaults before JAX starts.
"""

from __future__ import annotations

import dataclasses

from models.errors import UserError

DEFAULT_BATCH_TOKENS = 8192
DEFAULT_MODEL = "small"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str | None = None  # a preset; None: the checkpoint's model when resuming, else small
    strategy: str | None = None  # "data=2,fsdp=4"; default: data parallel over all devices
    strategies: str | None = None  # a TOML strategy table, or "auto" (planned)
    devices: int | None = None
    data: str | None = None  # default: the Python standard library
    tokenizer: str | None = None  # default: a byte-level BPE trained on the corpus, cached
    vocab_size: int = 8192
    context: int = 512
    steps: int = 30
    seed: int = 0
    batch_tokens: int | None = None  # real tokens per step (default 8192 unless sequences)
    batch_sequences: int | None = None  # or sequences per step
    long_documents: str = "split"  # into context-length pieces, or "truncate"
    compute_dtype: str = "bfloat16"
    loss_scale: str | None = None  # "dynamic", "off" or a static scale; None: dynamic for fp16
    initial_loss_scale: float = 2.0**15
    loss_scale_period: int = 2000
    remat: str | None = None  # for buckets whose table names none; None: fit to device_memory
    attention: str = "auto"  # the kernel: auto, blockwise, dense, cudnn, pallas
    attention_block: int = 0  # the blockwise kernel's block edge (0: the platform's default)
    lr: float = 1e-3
    warmup_steps: int = 10
    metrics_jsonl: str | None = None
    log_every: int = 10
    device_memory: float | None = None  # MiB per device the compiled steps must fit in
    bucket_timings: bool = False  # wait for each bucket to time it (a host sync per bucket)
    ckpt_dir: str | None = None  # save here, and resume from its latest complete checkpoint
    save_every: int | None = None  # default: save the last step only
    resume_from: str | None = None  # a step directory, or a checkpoint directory's latest
    keep_last: int = 3
    keep_every: int | None = None  # also keep every step that is a multiple of this

    @property
    def loss_scaling(self) -> tuple[str, float]:
        """("off" | "dynamic" | "static", the initial or static scale)."""
        if self.loss_scale is None:
            return ("dynamic" if self.compute_dtype == "float16" else "off",
                    self.initial_loss_scale)
        if self.loss_scale in ("dynamic", "off"):
            return self.loss_scale, self.initial_loss_scale
        try:
            return "static", float(self.loss_scale)
        except ValueError:
            raise UserError(f"--loss-scale {self.loss_scale}: give dynamic, off or a number "
                            f"(a static scale)") from None

    @property
    def batch(self) -> dict[str, int]:
        """The mini-batch size: real tokens, or sequences."""
        if self.batch_sequences is not None:
            return {"batch_sequences": self.batch_sequences}
        return {"batch_tokens": self.batch_tokens or DEFAULT_BATCH_TOKENS}

"""Run one drawn training configuration (``exactness/training_configs.py``) and check the exactness property.

Each configuration is trained three times, every time on a fresh model built from the same seeds:
streamed, with ``stream=False`` (the guarantee's reference) and, where the regions run the aten graph
(``codegen="eager"``) and the loss is HF's own (no ``chunked_loss``), as the user's plain eager loop on
the surface's plain counterpart (``transformers.Trainer``, ``trl.SFTTrainer``, no ``torch.compile``).
Every optimizer step records the loss of each micro-batch, the adapter's gradient norm, the adapter
weights and the full AdamW state (``parity.Trace``); the runs must be ``torch.equal`` on all of them.
A ``PorosError`` raised before the first optimizer step is a refusal, which the property allows; any
other failure, or a ``PorosError`` after a step was taken, is a crash.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import transformers
from torch import nn

from ..errors import PorosError
from ..options import AUTO
from ..prepare import prepare
from ..runtime.accumulate import block_major
from ..step import step as poros_step
from .parity import Trace, compare, optimizer_step
from ..models.tiny import add_lora, base_model, expert_parameter_paths, tiny_config
from ..models.tiny_tokenizer import chat_records, tiny_tokenizer
from .training_configs import EXPERT_COUNT, TrainingConfig

MODES = ("streamed", "stream=False", "eager")
SFT_VOCAB = 321  # above the tiny tokenizer's 300 tokens


class InvalidConfig(Exception):
    """transformers or PEFT refused the drawn model before poros saw it (no target module matched, say)."""


@dataclasses.dataclass
class Outcome:
    status: str  # "equal" | "refused" | "differs" | "crashed"
    detail: str  # the differences, the refusal's message or the crash's
    compared: tuple[str, ...]  # the references the streamed run was compared with
    seconds: float

    @property
    def holds(self) -> bool:
        return self.status in ("equal", "refused")


class RunFailed(Exception):
    """A run that raised; ``steps``: optimizer steps it had finished."""

    def __init__(self, mode: str, steps: int, error: BaseException) -> None:
        super().__init__(f"{mode}: {type(error).__name__}: {error}")
        self.mode, self.steps, self.error = mode, steps, innermost(error)


def innermost(error: BaseException) -> BaseException:
    """The error a backend raised, out of the ones Dynamo wraps it in (a ``PorosError`` as it is)."""
    while not isinstance(error, PorosError):
        inner = getattr(error, "inner_exception", None) or error.__cause__ or (
            None if error.__suppress_context__ else error.__context__)  # Dynamo re-raises fake-tensor errors
        if inner is None:
            return error
        error = inner
    return error


# -- the model and the data ----------------------------------------------------------------------------

def model_config(config: TrainingConfig) -> transformers.PretrainedConfig:
    s = config.shape
    vocab = SFT_VOCAB if config.surface == "sft" else s.vocab
    extra = dict(s.config)
    if "layer_types" in extra:
        extra["layer_types"] = list(extra["layer_types"])
    if s.family in ("qwen3", "gemma3_text", "qwen3_5_text", "gemma4_text"):
        extra["head_dim"] = s.head_dim
    if s.family == "gemma4_text":
        extra.setdefault("vocab_size_per_layer_input", vocab)
    return tiny_config(s.family, layers=s.layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, vocab=vocab,
                       intermediate=s.intermediate, **extra)


def build(config: TrainingConfig, *, attach: bool = True) -> nn.Module:
    """A fresh model of ``config`` on the CPU (the same bits every call); ``attach=False``: the base alone."""
    dtype = torch.float32 if config.base == "fp32" else torch.bfloat16
    try:
        model = base_model(model_config(config), dtype=dtype, nf4=config.base.startswith("nf4"),
                           nested=config.base == "nf4-nested", seed=config.seed)
        return attach_lora(config, model) if attach else model.requires_grad_(False)
    except (ValueError, TypeError, KeyError, IndexError) as e:  # transformers' or PEFT's own checks
        raise InvalidConfig(f"{type(e).__name__}: {e}") from None


def attach_lora(config: TrainingConfig, model: nn.Module) -> nn.Module:
    try:
        return add_lora(model, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                        targets=list(config.targets), dora=config.dora, seed=config.seed,
                        parameters=expert_parameter_paths(model) if config.expert_lora else ())
    except ValueError as e:
        if isinstance(e, PorosError):
            raise
        raise InvalidConfig(f"{type(e).__name__}: {e}") from None


def batches(config: TrainingConfig, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """One dict per micro-batch: ``input_ids``, ``labels`` and (padded data) ``attention_mask``."""
    d = config.data
    vocab = config.shape.vocab
    g = torch.Generator().manual_seed(d.seed)
    out = []
    for length in d.lengths:
        ids = torch.randint(1, vocab, (d.batch, length), generator=g)
        labels = ids.clone()
        batch = {"input_ids": ids}
        if d.padding != "none":
            mask = torch.ones_like(ids)
            for row in range(1, d.batch):  # row 0 keeps its whole length: the batch's length is real
                short = int(torch.randint(0, length - 1, (), generator=g))
                pad = slice(length - short, None) if d.padding == "right" else slice(0, short)
                mask[row, pad] = 0
            ids.masked_fill_(mask == 0, 0)
            labels.masked_fill_(mask == 0, -100)
            batch["attention_mask"] = mask
        if d.ignored:
            drop = torch.rand(ids.shape, generator=g) < 0.3
            drop[:, -1] = False  # every row keeps a trained token
            labels.masked_fill_(drop, -100)
        batch["labels"] = labels
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


def items_per_step(config: TrainingConfig, data: list[dict]) -> list[torch.Tensor | None]:
    """The Trainer's ``num_items_in_batch`` for each micro-batch (its step's trained tokens), or ``None``."""
    if not config.data.num_items:
        return [None] * len(data)
    out = []
    for start in range(0, len(data), config.accumulate):
        step = data[start:start + config.accumulate]
        count = sum((b["labels"][:, 1:] != -100).sum() for b in step)
        out.extend([count] * len(step))
    return out


# -- the process's numeric modes -----------------------------------------------------------------------

@contextlib.contextmanager
def numeric_modes(config: TrainingConfig, device: torch.device) -> Iterator[None]:
    """Deterministic algorithms, TF32 and SDPA's kernels as ``config`` draws them, restored afterwards."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    torch.use_deterministic_algorithms(config.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.tf32
    sdpa = contextlib.nullcontext()
    if device.type == "cuda" and not config.fast_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = sdpa_kernel(SDPBackend.MATH)
    try:
        with sdpa:
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


def autocast(config: TrainingConfig, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16) if config.autocast else contextlib.nullcontext()


# -- the options each surface takes --------------------------------------------------------------------

PREPARE_OPTIONS = ("block_size", "prefetch", "codegen", "memory_budget", "block_major", "chunked_loss",
                   "offload_boundaries", "sequence_chunks")


def poros_options(config: TrainingConfig, mode: str, base_bytes: int) -> dict[str, Any]:
    """The drawn options as the surfaces take them: the memory budget a multiple of the base's bytes."""
    options = {**config.option_dict, "stream": mode == "streamed", "block_major": config.block_major}
    budget = options.pop("memory_budget", None)
    if budget == AUTO:
        options["memory_budget"] = AUTO
    elif budget is not None:
        options["memory_budget"] = max(1, int(base_bytes * {"tiny": 0.25, "some": 0.8, "all": 3.0}[budget]))
    return options


def base_bytes(config: TrainingConfig) -> int:
    """The base's bytes unquantized (an NF4 block's dequantized weights are on the device while it runs)."""
    model = build(dataclasses.replace(config, base="bf16" if config.base.startswith("nf4") else config.base),
                  attach=False)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


# -- surfaces: each trains ``config`` in ``mode`` and returns its trace ------------------------------------

def prepared(config: TrainingConfig, device: torch.device, options: dict[str, Any]) -> nn.Module:
    kwargs = {k: options[k] for k in PREPARE_OPTIONS if k in options}
    if config.attach_after_prepare:
        model = prepare(build(config, attach=False), device=device, **kwargs)
        return attach_lora(config, model)
    return prepare(build(config), device=device, **kwargs)


def _record_toggles(config: TrainingConfig, model: nn.Module, step_model: Callable, batch: dict, trace: Trace,
                    device: torch.device) -> None:
    """The mode changes between the first two optimizer steps: their losses and gradients go in ``trace``."""
    params = [p for p in model.parameters() if p.requires_grad]
    for toggle in config.toggles:
        grad = toggle == "eval_with_grad"
        model.eval() if toggle != "adapter_off" else model.train()
        adapter_off = model.disable_adapter() if toggle == "adapter_off" else contextlib.nullcontext()
        with adapter_off, torch.set_grad_enabled(grad or toggle == "adapter_off"), autocast(config, device):
            loss = step_model(**batch).loss
        trace.losses.append(loss.detach().clone())
        if grad:
            loss.backward()
            trace.losses.extend(p.grad.clone() for p in params if p.grad is not None)
            model.zero_grad(set_to_none=True)
    model.train()


def _edit_adapter(model: nn.Module) -> None:
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_A" in n).mul_(0.5)


def _loop_steps(config: TrainingConfig, model: nn.Module, run_step: Callable[[list[dict], list], list],
                step_model: Callable, data: list[dict], device: torch.device, trace: Trace,
                opt: torch.optim.Optimizer, first: int, last: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    items = items_per_step(config, data)
    for step in range(first, last):
        at = slice(step * config.accumulate, (step + 1) * config.accumulate)
        trace.losses.extend(run_step(data[at], items[at]))
        if config.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, config.clip)
        optimizer_step(trace, params, opt)
        if step == 0:
            _record_toggles(config, model, step_model, data[0], trace, device)
            if config.edit_adapter:
                _edit_adapter(model)


def _forward_loss(config: TrainingConfig, step_model: Callable, batch: dict, items: Any, device: torch.device
                  ) -> torch.Tensor:
    with autocast(config, device):
        if items is not None:
            return step_model(**batch, num_items_in_batch=items).loss
        return step_model(**batch).loss / config.accumulate


def train_loop(config: TrainingConfig, mode: str, device: torch.device, trace: Trace) -> nn.Module:
    """``torch.compile(model, backend="poros")`` in the user's own loop (``eager``: the model as it is)."""
    data = batches(config, device)
    options = poros_options(config, mode, base_bytes(config)) if mode != "eager" else {}

    def start() -> tuple[nn.Module, Callable]:
        if mode == "eager":
            model = build(config).to(device)
            return model, model
        model = prepared(config, device, options)
        return model, torch.compile(model, backend="poros",
                                    options={k: v for k, v in options.items() if k not in PREPARE_OPTIONS})

    model, step_model = start()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)

    def run_step(micro_batches: list[dict], items: list) -> list[torch.Tensor]:
        losses = []
        order = block_major(model, micro_batches) if mode == "streamed" and config.block_major else contextlib.nullcontext()
        with order:
            for batch, n in zip(micro_batches, items):
                loss = _forward_loss(config, step_model, batch, n, device)
                loss.backward()
                losses.append(loss.detach().clone())
        return losses

    torch.manual_seed(config.seed)
    stop = config.resume_at if config.resume_at is not None and mode == "streamed" else config.steps
    _loop_steps(config, model, run_step, step_model, data, device, trace, opt, 0, stop)
    if stop == config.steps:
        return model
    # resume: a fresh model and optimizer take the adapter, the optimizer's state and the generator's
    saved = ({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
             copy.deepcopy(opt.state_dict()), torch.get_rng_state(),
             torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    del model, step_model, opt
    torch._dynamo.reset()
    model, step_model = start()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(saved[0][n])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(saved[1])
    torch.set_rng_state(saved[2])
    if saved[3] is not None:
        torch.cuda.set_rng_state(saved[3], device)
    _loop_steps(config, model, run_step, step_model, data, device, trace, opt, stop, config.steps)
    return model


def train_step_decorator(config: TrainingConfig, mode: str, device: torch.device, trace: Trace) -> nn.Module:
    """``@poros_fx.step(accumulate=N, **options)`` on the user's step function (``eager``: the function itself)."""
    data = batches(config, device)

    def one(model: nn.Module, batch: dict, items: Any = None) -> torch.Tensor:
        loss = _forward_loss(config, model, batch, items, device)
        loss.backward()
        return loss.detach().clone()

    if mode == "eager":
        model = build(config).to(device)

        def run_step(micro_batches: list[dict], items: list) -> list[torch.Tensor]:
            return [one(model, b, n) for b, n in zip(micro_batches, items)]
    else:
        options = poros_options(config, mode, base_bytes(config))
        model = build(config)
        decorated = poros_step(one, accumulate=config.accumulate, device=device, **options)

        def run_step(micro_batches: list[dict], items: list) -> list[torch.Tensor]:
            if config.data.num_items:
                return decorated(model, micro_batches, items[0])
            return decorated(model, micro_batches)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    torch.manual_seed(config.seed)
    _loop_steps(config, model, run_step, model, data, device, trace, opt, 0, config.steps)
    return model


class _Recorder(transformers.TrainerCallback):
    """The trace of a Trainer's run: gradient norms before each optimizer step, weights and state after."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module = None, **kw: Any) -> None:
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        self.trace.grad_norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module = None,
                          optimizer: Any = None, **kw: Any) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.trace.weights.append([p.detach().clone() for p in params])
        opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        self.trace.optimizer.append([t.detach().clone() for p in params for t in (
            opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"])])


def _recording(cls: type, trace: Trace) -> type:
    """``cls`` (a Trainer class) recording each micro-batch's loss as ``training_step`` returns it."""

    def training_step(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = cls.training_step(self, *args, **kwargs)
        trace.losses.append(loss.detach().clone())
        return loss

    return type(f"Recording{cls.__name__}", (cls,), {"training_step": training_step})


class _Rows(torch.utils.data.Dataset):
    """Each item is a whole micro-batch (already padded); the collator hands it over as it is."""

    def __init__(self, data: list[dict]) -> None:
        self.data = [{k: v.cpu() for k, v in b.items()} for b in data]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return self.data[i]


def _training_args(config: TrainingConfig, device: torch.device, out: str, cls: type, **extra: Any) -> Any:
    return cls(output_dir=out, max_steps=config.steps, per_device_train_batch_size=1 if cls is
               transformers.TrainingArguments else config.data.batch, gradient_accumulation_steps=config.accumulate,
               learning_rate=1e-2, max_grad_norm=config.clip or 0.0, logging_steps=1, seed=config.seed, report_to=[],
               use_cpu=device.type == "cpu", disable_tqdm=True, save_strategy="no", bf16=config.autocast,
               dataloader_num_workers=0, **extra)


def train_trainer(config: TrainingConfig, mode: str, device: torch.device, trace: Trace) -> nn.Module:
    """``PorosTrainer`` (``eager``: a plain ``transformers.Trainer``) on the drawn micro-batches."""
    from ..hf import PorosTrainer  # lazy: transformers.Trainer

    data = batches(config, torch.device("cpu"))
    model = build(config)
    cls = transformers.Trainer if mode == "eager" else PorosTrainer
    kwargs = {} if mode == "eager" else {"poros_options": {**poros_options(config, mode, base_bytes(config)),
                                                           "device": device}}
    with tempfile.TemporaryDirectory() as out:
        trainer = _recording(cls, trace)(
            model=model, args=_training_args(config, device, out, transformers.TrainingArguments),
            train_dataset=_Rows(data), data_collator=lambda items: items[0], callbacks=[_Recorder(trace)], **kwargs)
        trainer.remove_callback(transformers.PrinterCallback)  # the trace records the log; no print per step
        trainer.train()
    return model


def train_sft(config: TrainingConfig, mode: str, device: torch.device, trace: Trace) -> nn.Module:
    """``PorosSFTTrainer`` (``eager``: a plain ``trl.SFTTrainer``) on chat records, padded batches."""
    import datasets
    import trl

    from ..sft import PorosSFTTrainer  # lazy: trl

    d = config.data
    records = chat_records(config.steps * config.accumulate * d.batch + 2)
    extra = {"assistant_only_loss": d.ignored, "packing": d.padding == "left", "max_length": 24 + 4 * len(d.lengths)}
    if config.shape.family in EXPERT_COUNT:  # TRL's default (None) adds the architecture's own auxiliary loss
        extra["router_aux_loss_coef"] = dict(config.shape.config).get("router_aux_loss_coef")
    model = build(config)
    cls = trl.SFTTrainer if mode == "eager" else PorosSFTTrainer
    kwargs = {} if mode == "eager" else {"poros_options": {**poros_options(config, mode, base_bytes(config)),
                                                           "device": device}}
    with tempfile.TemporaryDirectory() as out:
        args = _training_args(config, device, out, trl.SFTConfig, gradient_checkpointing=False, **extra)
        trainer = _recording(cls, trace)(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                                         processing_class=tiny_tokenizer(), callbacks=[_Recorder(trace)], **kwargs)
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    return model


SURFACE_RUNS: dict[str, Callable[[TrainingConfig, str, torch.device, Trace], nn.Module]] = {
    "compile": train_loop, "step": train_step_decorator, "trainer": train_trainer, "sft": train_sft,
}


# -- one configuration ---------------------------------------------------------------------------------

def train_once(config: TrainingConfig, mode: str, device: torch.device) -> tuple[Trace, nn.Module]:
    """One training run of ``config`` and the model it trained; a failure raises ``RunFailed`` with the
    steps finished before it."""
    torch._dynamo.reset()
    trace = Trace()
    try:
        with numeric_modes(config, device):
            model = SURFACE_RUNS[config.surface](config, mode, device, trace)
    except InvalidConfig:
        raise
    except Exception as e:  # noqa: BLE001 - every failure is an outcome here
        raise RunFailed(mode, len(trace.weights), e) from e
    finally:
        torch._dynamo.reset()
    return trace, model


def eager_step(config: TrainingConfig, device: torch.device) -> None:
    """One plain eager forward and backward of the drawn model; ``InvalidConfig`` if it fails. LoRA on NF4
    experts is left out: PEFT's own forward never runs it (``eager_comparable``), so the question is whether
    transformers runs the model at all."""
    if config.expert_lora and config.base.startswith("nf4"):
        config = dataclasses.replace(config, expert_lora=False)
    try:
        with numeric_modes(config, device):
            model = build(config).to(device)
            batch = batches(config, device)[0]
            _forward_loss(config, model, batch, None, device).backward()
    except InvalidConfig:
        raise
    except Exception as e:  # noqa: BLE001
        raise InvalidConfig(f"the plain eager model fails too: {type(e).__name__}: {e}") from None


def eager_comparable(config: TrainingConfig) -> bool:
    """Whether the plain eager loop is a reference too: aten regions, HF's own loss, the MLP on the whole
    sequence at once, not LoRA on NF4 experts (PEFT's own forward cannot stack its parametrization on
    theirs), and not the open difference ``known_eager_difference`` names."""
    options = config.option_dict
    return (options.get("codegen") == "eager" and not options.get("chunked_loss")
            and options.get("sequence_chunks", 1) == 1 and not (config.expert_lora and config.base.startswith("nf4"))
            and not known_eager_difference(config))


def known_eager_difference(config: TrainingConfig) -> bool:
    """Open, found by this generator (docs/exactness.md), each equal to ``stream=False`` but not to the plain
    eager loop; ``tests/test_drawn_configs.py`` holds the first as a strict xfail:

    - the Trainer surfaces with bf16 autocast and LoRA dropout on Qwen3.5 (lora_A's gradient of a Gated
      DeltaNet projection, ~1e-9);
    - LoRA on Qwen3.5's Gated DeltaNet ``in_proj_qkv`` (the projection feeding its causal convolution):
      the adapter's weights after a step, ~1e-7, found with accumulation 2 on some hosts, equal on others
      (any accumulation is set aside until the cause is known; no xfail holds it, since it passes where
      the host's kernels agree).

    Qwen3.5-MoE has the same Gated DeltaNet layers: both are set aside for it too."""
    if config.shape.family not in ("qwen3_5_text", "qwen3_5_moe_text"):
        return False
    return ((config.surface in ("trainer", "sft") and config.autocast and config.dropout > 0)
            or "in_proj_qkv" in config.targets)


def check(config: TrainingConfig, device: str | torch.device = "cpu") -> Outcome:
    """Train ``config`` streamed and against its references; raises ``InvalidConfig`` for a model that
    transformers or PEFT refuse before poros sees it, or whose plain eager loop fails on its own."""
    device = torch.device(device)
    start = time.perf_counter()
    compared = ("stream=False", "eager") if eager_comparable(config) else ("stream=False",)

    def outcome(status: str, detail: str) -> Outcome:
        return Outcome(status, detail, compared, time.perf_counter() - start)

    try:
        # the streamed model stays alive: stream=False takes its regions instead of tracing them again (the
        # eager loop checks what runs inside them)
        streamed, streamed_model = train_once(config, "streamed", device)
    except RunFailed as failed:
        if isinstance(failed.error, PorosError) and failed.steps == 0:
            return outcome("refused", str(failed.error).splitlines()[0][:400])
        if not isinstance(failed.error, PorosError):
            eager_step(config, device)  # transformers or PEFT failing on their own: not poros's crash
        return outcome("crashed", _crash_text(failed))
    for reference in compared:
        try:
            other, _ = train_once(config, reference, device)
        except RunFailed as failed:
            if reference == "eager" and not isinstance(failed.error, PorosError):
                # the plain loop on its own (bitsandbytes' CPU inference packing of an NF4 weight, say)
                raise InvalidConfig(f"the plain eager loop fails on its own: {_crash_text(failed)}") from None
            return outcome("crashed", f"the streamed run ran, {reference} did not: {_crash_text(failed)}")
        diffs = compare(streamed, other)
        if any(v != 0.0 for v in diffs.values()):
            return outcome("differs", f"vs {reference}: " + " ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    del streamed_model
    if not streamed.weights:
        return outcome("crashed", "no optimizer step was recorded")
    return outcome("equal", f"{len(streamed.weights)} steps, {len(streamed.losses)} losses")


def _crash_text(failed: RunFailed) -> str:
    """The innermost error (Dynamo wraps the backend's) on one line, and where in poros it was raised."""
    error = failed.error
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                  for f in reversed(frames) if "poros_fx" in f.filename or "passes" in f.filename), "?")
    message = " ".join(str(error).split())
    if len(message) > 700:  # Dynamo's messages put the cause last
        message = f"{message[:250]} ... {message[-450:]}"
    return (f"{failed.mode}: {type(error).__name__}: {message} (after {failed.steps} optimizer steps; raised at "
            f"{where})")

"""The one training loop behind ``poros-fx train`` and ``poros_fx.FineTuner``: model, data, the optimizer
loop with its controls, saves on the way and on Ctrl-C or SIGTERM.

``load_model(opts)`` builds the prepared PEFT model (and finds its tokenizer); ``train(opts, ...)`` reads
the data and runs the loop on it. The command (``cli.train``) and the Python surface (``finetune.py``)
both call these two, so a run is the same bits whichever started it. Errors are raised as
``PorosError`` (the command prints them as one line).

The loop is written so that a stopped run can continue bit-exactly: the data order depends on the seed
alone (not on the step count), the learning rate of a step on its number alone (``schedules.py``), the
RNG states are taken after each finished step, and Ctrl-C (or SIGTERM, what job schedulers send) is held
while an optimizer step and its bookkeeping run, so that what is saved (``run_state``) is always one whole
step.

Per step: the micro-batches' forward and backward through ``torch.compile(model, backend="poros")``
(block-major with ``accumulate`` > 1), gradient clipping (``max_grad_norm``), the learning rate of the
step (warmup, then constant / linear / cosine), ``AdamW.step()``. Every ``eval_every`` steps the
``eval_data`` loss (``evaluation.py``, under ``torch.no_grad()``, dropout off). Each step's metrics go
to ``OUT/metrics.jsonl`` (``metrics.py``).

Under ``torchrun --nproc-per-node N -m poros_fx train ...`` every rank loads the base (one
shared host copy per host, ``poros_fx.distributed``), trains through ``DistributedDataParallel`` on
every N-th micro-batch of the one data order (the global batch is N x ``batch_size`` rows), logs the
ranks' mean loss, and rank 0 alone prints and saves; the adapter is the same on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import dataclasses
import itertools
import math
import signal
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import peft
import torch
from torch import nn

from .. import distributed, stats
from ..errors import PorosConfigError, PorosError
from ..families import resolve
from ..handles import causal_lm, get_store
from ..io.data import TokenDataset, batches
from ..io.loader import from_config as random_model
from ..io.loader import load_pretrained
from ..options import AUTO
from ..prepare import set_trace_options
from ..report import report
from ..runtime.accumulate import step_context
from ..runtime.lengths import mark_dynamic
from ..units import format_bytes, parse_size
from ..compiler.estimate import (LONG_SEQUENCE_OPTIONS, long_context_plan, long_sequence_advice, lora_bytes,
                                 options_to_add, step_memory)
from .evaluation import evaluate
from .metrics import MetricsLog
from .options import CONFIG_KEYS, OPTION_NAMES, TrainOptions
from .run_config import RUN_CONFIG_FILE, write_run_config
from .run_state import (STATE_FILE, Named, check_resumable, checkpoint_folder, fingerprint, keep_checkpoints,
                        model_fingerprint, remove_stale_saves, restore, rng_state, save_train_state)
from .schedules import lr_factors, set_lr
from .sources import (as_path, check_seq_len, check_targets, read_data, save_tokenizer, target_modules, tokenizer_of,
                      train_source)
from .terminal import StepLog, console, folder_problem, quoted


@dataclasses.dataclass
class Session:
    """A prepared model ready to train, with what it was built from."""

    model: nn.Module  # the PEFT model, prepared (its base in the host store)
    config: Any  # its transformers config
    folder: Optional[Path]  # where its checkpoint (and tokenizer) lie; None for a built-in shape
    tokenizer: Any  # transformers tokenizer, or None
    targets: list[str]  # the LoRA target modules
    device: torch.device  # where the adapter lives (the compute device)
    ranks: distributed.Ranks  # torchrun's; one process is rank 0 of 1


@dataclasses.dataclass
class TrainResult:
    """What a ``train`` call did."""

    steps: int  # the step the run ended after
    losses: list[float]  # per finished step, from the first of the run (a resumed run's earlier ones too)
    eval_losses: dict[int, float]  # step -> eval loss
    out: Optional[Path]


def load_model(opts: TrainOptions, ranks: Optional[distributed.Ranks] = None) -> Session:
    """The prepared PEFT model ``opts`` describe, its LoRA initialised from ``opts.seed``."""
    o = opts
    ranks = ranks or distributed.launched_ranks()
    config, folder = train_source(o.model, o.from_config)
    targets = target_modules(o.target_modules, config.model_type)
    if targets != target_modules(None, config.model_type):
        check_targets(targets, config)
    torch.manual_seed(o.seed)  # the LoRA A init and, in the loop, the dropout masks
    lora = peft.LoraConfig(r=o.lora_r, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout, target_modules=targets)
    device = o.device
    if ranks.distributed and (device is None or device == "cuda"):
        device = distributed.rank_device(ranks)  # cuda:LOCAL_RANK (the CPU without CUDA)
    common = {"quantization": o.quantization, "device": device, "lora": lora, **o.prepare_options()}
    try:
        model = load_pretrained(folder, **common) if o.model is not None else random_model(config, seed=o.seed, **common)
    except ValueError as e:  # peft: target modules that match no module of the model
        if isinstance(e, PorosConfigError):
            raise
        raise PorosConfigError(f"LoRA setup failed: {e}") from None
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Session(model=model, config=config, folder=folder, tokenizer=tokenizer_of(folder), targets=targets,
                   device=trainable[0].device, ranks=ranks)


@dataclasses.dataclass
class _Run:
    """A run ready to step: the session, its compiled step, optimizer and data, and how far it has gone."""

    opts: TrainOptions
    session: Session
    step_model: nn.Module  # the model under torch.compile(backend="poros")
    named: Named
    optimizer: torch.optim.Optimizer
    dataset: TokenDataset
    eval_dataset: Optional[TokenDataset]
    data_sha256: str
    steps: int  # the step the run ends after
    done: int  # steps finished before this call (a resumed run's)
    losses: list[float]  # per finished step
    eval_losses: dict[int, float]
    record: dict[str, Any]  # what --resume needs to rebuild this run (kept in the state as "run")
    metrics: MetricsLog

    def save(self, folder: Path, step: int, rng: dict[str, torch.Tensor]) -> None:
        """Adapter, resume state, tokenizer and run.toml of ``step`` (finished, with the RNG states after it)."""
        save_train_state(folder, self.session.model, self.named, self.optimizer, rng, {
            "step": step, "steps": self.steps, "micro_batches": step * self.opts.accumulate,
            "losses": self.losses[:step], "data_sha256": self.data_sha256, "run": self.record,
            "eval_losses": {str(k): v for k, v in self.eval_losses.items() if k <= step}})
        save_tokenizer(self.session.tokenizer, folder)
        write_run_config(folder / RUN_CONFIG_FILE, {k: v for k, v in self.record.items() if k in CONFIG_KEYS})


def train(opts: TrainOptions, session: Optional[Session] = None, resume: Optional[Path] = None,
          saved: Optional[tuple[dict, dict]] = None) -> TrainResult:
    """Train the LoRA adapter of ``session`` (built from ``opts`` when not given) on ``opts.data`` and write it
    (with its resume state) into ``opts.out`` when set; ``resume``/``saved``: the folder and the
    ``(meta, tensors)`` of the run this one continues."""
    opts.check()
    ranks = session.ranks if session is not None else distributed.launched_ranks()
    if ranks.distributed and not torch.distributed.is_initialized():
        distributed.init_process_group()
        if ranks.rank != 0:
            console.quiet = True  # rank 0 speaks for the job
    if opts.out is not None and ranks.rank == 0:
        problem = folder_problem(opts.out)
        if problem is not None:
            raise PorosConfigError(f"cannot write into --out {opts.out}: {problem}; give another folder")
    run = None
    try:
        run = _set_up(opts, session, resume, saved, ranks)
        loss, rng = _loop(run, resume)
        with interrupt_after():
            if ranks.rank == 0 and opts.out is not None:
                run.save(opts.out, run.steps, rng)
        _summary(run, loss)
        run.metrics.close()
        return TrainResult(steps=run.steps, losses=list(run.losses), eval_losses=dict(run.eval_losses), out=opts.out)
    finally:
        if ranks.distributed and session is None and torch.distributed.is_initialized():
            # the DDP module's reducer holds the process group: it goes first (freed after the group is
            # destroyed, its gloo threads wait for a peer that is gone)
            run = None
            gc.collect()
            torch.distributed.destroy_process_group()


def _set_up(opts: TrainOptions, session: Optional[Session], resume: Optional[Path],
            saved: Optional[tuple[dict, dict]], ranks: distributed.Ranks) -> _Run:
    """Config and data, then the model (a bad data file fails in seconds, before any weight is read), then
    the optimizer, and the saved step restored into both when resuming."""
    o = opts
    config, folder = (session.config, session.folder) if session is not None else train_source(o.model, o.from_config)
    check_seq_len(config, o.seq_len, o.model or o.from_config)
    tokenizer = session.tokenizer if session is not None else tokenizer_of(folder)
    data_args = {"config": config, "folder": folder, "shape": o.from_config, "seq_len": o.seq_len, "pack": o.pack,
                 "train_on": o.train_on, "tokenizer": tokenizer}
    dataset = read_data(o.data, split=o.split, **data_args)
    eval_dataset = read_data(o.eval_data, split=None, **data_args) if o.eval_data is not None else None
    steps = o.steps
    if steps is None:
        steps = max(1, math.ceil((1.0 if o.epochs is None else o.epochs) * dataset.rows
                                 / (o.batch_size * o.accumulate * ranks.world_size)))
    data_sha256 = fingerprint(dataset)
    done = 0 if saved is None else check_resumable(saved[0], data_sha256, steps, resume, dataset.source)
    saved_world = ranks.world_size if saved is None else saved[0]["run"].get("world_size", 1)
    if saved_world != ranks.world_size:  # each rank's data position depends on the number of ranks
        raise PorosConfigError(
            f"--resume {resume} continues a run of {saved_world} rank(s); this job has {ranks.world_size}. Resume it "
            f"with torchrun --nproc-per-node {saved_world}" if saved_world > 1 else
            f"--resume {resume} continues a single-process run; resume it without torchrun")
    console.print(f"data: {dataset.source}: {dataset.examples} examples ({', '.join(dataset.kinds)}) -> "
                  f"{dataset.rows} rows of {o.seq_len} tokens, {dataset.supervised_tokens} trained tokens; "
                  f"{steps} step(s) of {o.accumulate} x {o.batch_size} rows"
                  + (f"; resuming after step {done}" if saved is not None else "")
                  + (f"; eval: {eval_dataset.source}, {eval_dataset.rows} rows" if eval_dataset is not None else ""),
                  soft_wrap=True, highlight=False)
    if session is None:
        session = load_model(o, ranks)
    model, device = session.model, session.device
    added = _fit_device_memory(o, session)
    o = dataclasses.replace(o, **added)  # the run's record keeps them: a resumed run prepares with them

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    console.print(report(model), soft_wrap=True, highlight=False)
    console.print(f"model: {config.model_type}, {o.quantization} base streamed on {device}, LoRA r={o.lora_r} "
                  f"alpha={o.lora_alpha} on {', '.join(session.targets)} ({sum(p.numel() for p in trainable):,} "
                  f"trainable parameters)", soft_wrap=True, highlight=False)
    model.train()
    # several ranks: DDP with the host store ignored, all-reducing the adapter's gradients
    options = {**o.step_options(), **added}  # prepare took the others; these override what it was given
    set_trace_options(model, options)
    step_model = torch.compile(distributed.data_parallel(model) if ranks.distributed else model, backend="poros",
                               options=options)
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, weight_decay=o.weight_decay)
    losses: list[float] = []
    eval_losses: dict[int, float] = {}
    if saved is not None:
        meta, tensors = saved
        losses = restore(meta, tensors, named, optimizer, device, resume / STATE_FILE)
        eval_losses = {int(k): v for k, v in meta.get("eval_losses", {}).items()}
    record = {**{name: getattr(o, name) for name in OPTION_NAMES if name not in ("epochs", "out")},
              "model": as_path(o.model), "from_config": as_path(o.from_config), "data": as_path(o.data),
              "eval_data": as_path(o.eval_data), "target_modules": session.targets, "device": device.type,
              "steps": steps, "world_size": ranks.world_size,
              "model_sha256": _model_sha256(folder) if o.model is not None else None}
    metrics = MetricsLog(o.out, enabled=o.metrics and ranks.rank == 0) if o.out is not None else MetricsLog(Path("."),
                                                                                                          enabled=False)
    if saved is not None and ranks.rank == 0:
        # a run killed after its last save logged steps the resumed run takes again
        metrics.cut_after(done)
        for stopped in {resume, o.out} - {None}:
            remove_stale_saves(stopped)
    return _Run(opts=o, session=session, step_model=step_model, named=named, optimizer=optimizer, dataset=dataset,
                eval_dataset=eval_dataset, data_sha256=data_sha256, steps=steps, done=done, losses=losses,
                eval_losses=eval_losses, record=record, metrics=metrics)


def _model_sha256(folder: Optional[Path]) -> Optional[str]:
    return model_fingerprint(folder) if folder is not None else None


def _fit_device_memory(o: TrainOptions, session: Session) -> dict[str, Any]:
    """A memory budget below what the streamed step is estimated to need is refused here, before anything
    compiles (``poros-fx check`` shows the same estimate). On CUDA, where the sequence is what does not fit
    and the long-sequence options that would fit were left to their defaults, they are turned on and said
    so; returns them (empty when none)."""
    store = get_store(session.model)
    if o.memory_budget == AUTO and store.device.type == "cuda":  # what the device has free now, the base on the host
        budget = torch.cuda.mem_get_info(store.device)[0]
        given = f"the device's free memory ({format_bytes(budget)}; memory_budget auto)"
    else:
        budget = None if o.memory_budget == AUTO else parse_size(o.memory_budget)
        given = f"--memory-budget {o.memory_budget} ({format_bytes(budget or 0)})"
    if budget is None:
        return {}
    sizes = store.block_bytes()
    ahead = 1 if store.prefetch == AUTO else store.prefetch
    window = (1 + ahead) * max([*sizes[:-1], -(-sizes[-1] // store.head_chunks)])
    advice = None  # on CUDA, where it does not fit: the options or the length that would
    if store.device.type == "cuda":
        family = resolve(session.config.model_type)
        adapter = lora_bytes(session.config, family, session.targets, o.lora_r)
        loss_chunks = len(causal_lm(session.model)._poros_loss_chunks) or None  # none: the head cannot be chunked
        est = step_memory(session.config, window, seq=o.seq_len, batch=o.batch_size,
                          in_flight=o.accumulate if o.block_major else 1, adapter_bytes=adapter,
                          loss_chunks=loss_chunks if o.chunked_loss else None,
                          offload_boundaries=bool(o.offload_boundaries), sequence_chunks=o.sequence_chunks or 1,
                          nf4_experts=o.quantization == "nf4")
        need, what = est.total, f"the streamed step's estimated device memory at seq {o.seq_len}"
        if need > budget:
            chosen = {k: getattr(o, k) for k in LONG_SEQUENCE_OPTIONS}
            plan = long_context_plan(session.config, window, seq=o.seq_len, batch=o.batch_size, adapter_bytes=adapter,
                                     device_memory=budget, loss_chunks=loss_chunks, nf4_experts=o.quantization == "nf4")
            advice = long_sequence_advice(plan, chosen)
            # the plan counts one micro-batch in flight, and its options turn CUDA graphs off
            fits_plan = (o.accumulate == 1 or not o.block_major) and o.cuda_graphs is not True
            added = options_to_add(plan, chosen) if fits_plan else {}
            if added:
                console.print(f"long sequence: {what} is {format_bytes(need)}, more than {given}; turning on "
                              f"{', '.join(f'{k}={v!r}' for k, v in added.items())} (estimated "
                              f"{format_bytes(plan.memory.total)}). They are not the eager loop's kernels "
                              "(docs/exactness.md); give these options yourself to choose otherwise",
                              soft_wrap=True, highlight=False)
                return added
    else:  # on the CPU the budget counts base bytes only (runtime/budget.py)
        need, what = window, f"the streamed base window ((1 + prefetch {ahead}) x the largest block)"
    if budget < need:
        if o.memory_budget == AUTO:
            raise PorosConfigError(f"{what}, {format_bytes(need)}, is more than {given}: {advice}; "
                                   "`poros-fx check MODEL --seq-len N --device-memory SIZE` shows the estimate")
        raise PorosConfigError(f"{given} is below {what}, {format_bytes(need)}: raise it to at least that"
                               + (f" ({advice})" if advice else "")
                               + ", or leave --memory-budget out to stream every block (`poros-fx check` shows the "
                               "estimate)")
    return {}


class Interrupted(PorosError):
    """Ctrl-C or SIGTERM during ``train``: the last finished step was saved (when the run has an ``out``); the
    message says where and how to resume (the command exits with 130)."""


def _loop(run: _Run, resume: Optional[Path]) -> tuple[float, dict[str, torch.Tensor]]:
    """Steps ``run.done + 1 .. run.steps``, saving every ``save_every``; returns the last step's loss and the RNG
    states after it. On Ctrl-C or SIGTERM the last finished step is saved and ``Interrupted`` raised."""
    o, dev, world = run.opts, run.session.device, run.session.ranks.world_size
    ranks, model = run.session.ranks, run.session.model
    # one data order for the job; rank r takes micro-batches r, r + N, r + 2N, ...
    micro = itertools.islice(batches(run.dataset, o.batch_size, run.steps * o.accumulate * world, o.seed),
                             ranks.rank, None, world)
    for _ in range(run.done * o.accumulate):  # the data position: the same order, the batches already trained skipped
        next(micro)
    factor = lr_factors(o.schedule, o.warmup_steps, run.steps)
    trainable = [p for _, p in run.named]
    tokens_per_step = o.accumulate * o.batch_size * o.seq_len * world
    done = run.done
    rng = rng_state(dev)  # the generators as they stand after the last finished step
    loss_value = run.losses[-1] if run.losses else float("nan")
    try:
        with (terminate_as_interrupt(),
              distributed.no_ddp_optimizer() if ranks.distributed else contextlib.nullcontext(),
              StepLog(run.steps, o.log_every, start=run.done) as log):
            for step in range(run.done + 1, run.steps + 1):
                start = time.perf_counter()
                total = torch.zeros((), device=dev)
                # every length from one compile (runtime/lengths.py)
                micro_batches = [mark_dynamic({k: v.to(dev) for k, v in next(micro).items()})
                                 for _ in range(o.accumulate)]
                # with accumulate N each block is loaded once for the N micro-batches, where it can
                # (runtime/accumulate.py decides, as for @poros_fx.step and PorosTrainer)
                with step_context(model, micro_batches, block_major_option=o.block_major,
                                  data_parallel=ranks.distributed):
                    for batch in micro_batches:
                        loss = run.step_model(**batch, use_cache=False).loss / o.accumulate  # mean over micro-batches
                        loss.backward()
                        total += loss.detach()
                if ranks.distributed:  # the log shows the ranks' mean loss (every rank sees it)
                    torch.distributed.all_reduce(total)
                    total /= world
                with interrupt_after():  # a step is saved whole or not at all
                    grad_norm = (torch.nn.utils.clip_grad_norm_(trainable, o.max_grad_norm).item()
                                 if o.max_grad_norm is not None else None)
                    lr = set_lr(run.optimizer, o.lr, factor, step)
                    run.optimizer.step()
                    run.optimizer.zero_grad(set_to_none=True)
                    loss_value = total.item()
                    run.losses.append(loss_value)
                    done, rng = step, rng_state(dev)
                if not math.isfinite(loss_value):
                    raise PorosConfigError(f"step {step}: loss is {loss_value}; lower the learning rate, or check the data")
                seconds = time.perf_counter() - start
                log.step(step, loss_value, seconds, tokens=tokens_per_step)
                run.metrics.write({"step": step, "loss": loss_value, "learning_rate": lr,
                                   **({"grad_norm": grad_norm} if grad_norm is not None else {}),
                                   "tokens": tokens_per_step, "tokens_per_second": tokens_per_step / seconds,
                                   "seconds": seconds})
                if run.eval_dataset is not None and (step % o.eval_every == 0 if o.eval_every else step == run.steps):
                    _evaluate(run, step, log)
                if o.save_every is not None and step % o.save_every == 0 and step < run.steps and ranks.rank == 0 \
                        and o.out is not None:
                    _save_periodic(run, step, rng)
                    log.note(f"step {step}: adapter and resume state saved to {o.out}/")
    except KeyboardInterrupt:
        out = o.out
        if out is None:
            raise Interrupted(f"interrupted after step {done}/{run.steps} (nothing saved: no output folder)") from None
        if done == 0 or (done == run.done and resume is not None and out.resolve() == resume.resolve()):
            raise Interrupted("interrupted before a step finished; nothing new to save" + (
                f" (the run in {out}/ is still at step {done}: `{quoted('poros-fx train --resume {}', out)}`)"
                if done else "")) from None
        if ranks.rank == 0:
            with contextlib.suppress(KeyboardInterrupt), interrupt_after():  # a second signal waits for the save
                run.save(out, done, rng)
        raise Interrupted(f"interrupted: step {done}/{run.steps} saved to {out}/ (adapter + resume state). Continue with "
                          f"`{quoted('poros-fx train --resume {}', out)}`") from None
    return loss_value, rng


def _evaluate(run: _Run, step: int, log: StepLog) -> None:
    """The eval data's loss now, under ``torch.no_grad()`` with dropout off (draws no random numbers)."""
    model = run.session.model
    model.eval()
    try:
        result = evaluate(run.step_model, run.eval_dataset, run.opts.batch_size, run.session.device)
    finally:
        model.train()
    run.eval_losses[step] = result.loss
    run.metrics.write({"step": step, "eval_loss": result.loss, "eval_perplexity": result.perplexity})
    log.note(f"step {step}: eval loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  "
             f"({result.tokens} tokens, {result.seconds:.1f} s)")


def _save_periodic(run: _Run, step: int, rng: dict[str, torch.Tensor]) -> None:
    """``save_every``: the run's folder (what ``--resume OUT`` reads) and, with ``save_total_limit`` K > 0, a
    ``checkpoint-STEP`` folder, of which the newest K are kept."""
    out = run.opts.out
    run.save(out, step, rng)
    if run.opts.save_total_limit:
        run.save(checkpoint_folder(out, step), step, rng)
        keep_checkpoints(out, run.opts.save_total_limit)


def _summary(run: _Run, loss: float) -> None:
    """Where the adapter went and what to do with it, and what streaming cost."""
    o, out, steps = run.opts, run.opts.out, run.steps
    s = stats(run.session.model)
    where = f"adapter written to {out}/" if out is not None else "adapter in memory (FineTuner.save(DIR) writes it)"
    if out is None:
        text = f"final loss {loss:.4f} after {steps} steps; {where}"
    elif o.from_config is not None:
        text = (f"final loss {loss:.4f} after {steps} steps; {where}. It was trained on random weights "
                f"(--from-config {o.from_config}, seed {o.seed}) and fits only that random base: there is no checkpoint "
                f"for `poros-fx export` to merge it into. Evaluate it with "
                f"`{quoted('poros-fx eval {} --adapter {} --data DATA --seed {}', o.from_config, out, o.seed)}`, continue "
                f"it with `{quoted('poros-fx train --resume {} --steps N', out)}`, or load it with "
                f"poros_fx.from_config(config, seed={o.seed}, adapter={str(out)!r})")
    else:
        text = (f"final loss {loss:.4f} after {steps} steps; {where} (peft.PeftModel.from_pretrained, "
                f"`{quoted('poros-fx eval {} --adapter {} --data DATA', o.model, out)}`, "
                f"`{quoted('poros-fx export {} --base {} -o MERGED', out, o.model)}`, or "
                f"`{quoted('poros-fx train --resume {} --steps N', out)}` to train further)")
    console.print(text, soft_wrap=True, highlight=False)
    # the peak is of the blocks' device copies, each layer one span of the host arena (alignment gaps
    # included): compared with what every block at once would copy, not with the tensors' own bytes
    console.print(f"poros: peak resident base {format_bytes(s['peak_resident_base_bytes'])} of "
                  f"{format_bytes(sum(s['block_bytes']))} that all blocks copy at once ({format_bytes(s['host_bytes'])} "
                  f"of tensors in the host store); {s['loads']} loads ({format_bytes(s['bytes_loaded'])}), "
                  f"{s['recomputed_blocks']} recomputed blocks, block size {s['block_size']}, prefetch {s['prefetch']}",
                  soft_wrap=True, highlight=False)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (what job schedulers send to stop a job) inside the block raises ``KeyboardInterrupt``, as Ctrl-C
    does, so the loop saves the last finished step; the previous handler is back after the block. Outside the
    main thread, where no handler can be set, the block runs as is."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupt_after() -> Iterator[None]:
    """Ctrl-C or SIGTERM inside the block is held until its end (the optimizer step and its bookkeeping are
    never cut in half) and raised then as ``KeyboardInterrupt``; outside the main thread, where no handler can
    be set, the block runs as is."""
    caught: list[int] = []
    try:
        previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        raise KeyboardInterrupt

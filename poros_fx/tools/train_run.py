"""One ``poros-fx train`` run: data and model set up, the optimizer loop, saves on the way and on Ctrl-C.

The command (``cli.train``) only reads the options, or takes them from the state of the run it
resumes; this is the rest. The loop is written so that a stopped run can continue bit-exactly: the
data order depends on the seed alone (not on the step count), the RNG states are taken after each
finished step, and Ctrl-C is held while an optimizer step and its bookkeeping run, so that what is
saved (``run_state``) is always one whole step.

Under ``torchrun --nproc-per-node N -m poros_fx.tools.cli train ...`` every rank loads the base (one
shared host copy per host, ``poros_fx.distributed``), trains through ``DistributedDataParallel`` on
every N-th micro-batch of the one data order (the global batch is N x ``--batch-size`` rows), logs the
ranks' mean loss, and rank 0 alone prints and saves; the adapter is the same on every rank.
"""

from __future__ import annotations

import contextlib
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
from ..errors import PorosError
from ..io.data import TokenDataset, batches
from ..io.loader import from_config as random_model
from ..io.loader import load_pretrained
from ..runtime.accumulate import block_major
from .report import format_bytes, report
from .run_state import STATE_FILE, Named, check_resumable, fingerprint, restore, rng_state, save_train_state
from .sources import as_path, read_data, target_modules, train_source
from .terminal import StepLog, console, fail


@dataclasses.dataclass
class TrainOptions:
    """The train command's options, as typed or as the resumed run saved them (``run_state.SETTINGS``)."""

    model: Optional[str]  # a checkpoint folder or cached hub id; or None with from_config
    from_config: Optional[str]  # a built-in shape or config: random weights
    data: str
    out: Path
    quantization: str
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: Optional[list[str]]
    steps: Optional[int]  # None: from epochs (default 1) and the data
    epochs: Optional[float]
    lr: float
    weight_decay: float
    seq_len: int
    pack: bool
    batch_size: int
    accumulate: int
    block_size: int
    prefetch: int | str
    codegen: Optional[str]
    device: Optional[str]
    seed: int
    log_every: Optional[int]
    save_every: Optional[int]
    memory_budget: Optional[str] = None
    block_major: bool = True  # --accumulate N: each block runs all N micro-batches while loaded (runtime/accumulate.py)


@dataclasses.dataclass
class _Run:
    """A run ready to step: the prepared model, its optimizer and data, and how far it has gone."""

    opts: TrainOptions
    model: nn.Module  # the PEFT model, prepared (its base in the host store)
    step_model: nn.Module  # the same under torch.compile(backend="poros")
    named: Named
    optimizer: torch.optim.Optimizer
    device: torch.device
    ranks: distributed.Ranks  # torchrun's; one process is rank 0 of 1
    dataset: TokenDataset
    data_sha256: str
    steps: int  # the step the run ends after
    done: int  # steps finished before this command (a resumed run's)
    losses: list[float]  # per finished step
    record: dict[str, Any]  # what --resume needs to rebuild this run (kept in the state as "run")

    def save(self, step: int, rng: dict[str, torch.Tensor]) -> None:
        """Adapter and resume state of ``step`` (finished, with the RNG states after it) into ``--out``."""
        save_train_state(self.opts.out, self.model, self.named, self.optimizer, rng, {
            "step": step, "steps": self.steps, "micro_batches": step * self.opts.accumulate,
            "losses": self.losses[:step], "data_sha256": self.data_sha256, "run": self.record})


def train(opts: TrainOptions, resume: Optional[Path] = None, saved: Optional[tuple[dict, dict]] = None) -> None:
    """Train a LoRA adapter as ``opts`` say and write it (with its resume state) into ``opts.out``;
    ``resume``/``saved``: the folder and the ``(meta, tensors)`` of the run this one continues."""
    ranks = distributed.launched_ranks()
    if ranks.distributed:
        distributed.init_process_group()
        if ranks.rank != 0:
            console.quiet = True  # rank 0 speaks for the job
    try:
        run = _set_up(opts, resume, saved, ranks)
        loss, rng = _loop(run, resume)
        with interrupt_after():
            if ranks.rank == 0:
                run.save(run.steps, rng)
        _summary(run, loss)
    finally:
        if ranks.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _set_up(opts: TrainOptions, resume: Optional[Path], saved: Optional[tuple[dict, dict]],
            ranks: distributed.Ranks = distributed.Ranks()) -> _Run:
    """Config, data and model (in that order: a bad data file fails in seconds, before any weight is read),
    then the optimizer, and the saved step restored into both when resuming."""
    o = opts
    try:
        config, folder = train_source(o.model, o.from_config)
        dataset = read_data(o.data, config, folder, o.from_config, o.seq_len, o.pack)
        steps = o.steps
        if steps is None:
            steps = max(1, math.ceil((1.0 if o.epochs is None else o.epochs) * dataset.rows
                                     / (o.batch_size * o.accumulate * ranks.world_size)))
        data_sha256 = fingerprint(dataset)
        done = 0 if saved is None else check_resumable(saved[0], data_sha256, steps, resume, dataset.source)
        saved_world = ranks.world_size if saved is None else saved[0]["run"].get("world_size", 1)
        if saved_world != ranks.world_size:  # each rank's data position depends on the number of ranks
            raise fail(f"--resume {resume} continues a run of {saved_world} rank(s); this job has {ranks.world_size}. "
                       f"Resume it with torchrun --nproc-per-node {saved_world}" if saved_world > 1 else
                       f"--resume {resume} continues a single-process run; resume it without torchrun")
        console.print(f"data: {dataset.source}: {dataset.examples} examples ({', '.join(dataset.kinds)}) -> "
                      f"{dataset.rows} rows of {o.seq_len} tokens, {dataset.supervised_tokens} trained tokens; "
                      f"{steps} step(s) of {o.accumulate} x {o.batch_size} rows"
                      + (f"; resuming after step {done}" if saved is not None else ""), soft_wrap=True, highlight=False)

        torch.manual_seed(o.seed)  # the LoRA A init and, in the loop, the dropout masks
        targets = target_modules(o.target_modules, config.model_type)
        lora = peft.LoraConfig(r=o.lora_r, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout, target_modules=targets)
        device = o.device
        if ranks.distributed and (device is None or device == "cuda"):
            device = distributed.rank_device(ranks)  # cuda:LOCAL_RANK (the CPU without CUDA)
        common = {"quantization": o.quantization, "device": device, "block_size": o.block_size,
                  "prefetch": o.prefetch, "lora": lora, "codegen": o.codegen, "memory_budget": o.memory_budget}
        if o.model is not None:
            model = load_pretrained(folder, **common)
        else:
            model = random_model(config, seed=o.seed, **common)
    except PorosError as e:
        raise fail(str(e))
    except ValueError as e:  # peft: --target-modules that match no module of the model
        raise fail(f"LoRA setup failed: {e}")

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    device = trainable[0].device
    console.print(report(model), soft_wrap=True, highlight=False)
    console.print(f"model: {config.model_type}, {o.quantization} base streamed on {device}, LoRA r={o.lora_r} "
                  f"alpha={o.lora_alpha} on {', '.join(targets)} ({sum(p.numel() for p in trainable):,} trainable "
                  f"parameters)", soft_wrap=True, highlight=False)
    model.train()
    # several ranks: DDP with the host store ignored, all-reducing the adapter's gradients
    step_model = torch.compile(distributed.data_parallel(model) if ranks.distributed else model, backend="poros",
                               options={"block_major": o.block_major})
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, weight_decay=o.weight_decay)
    losses: list[float] = []
    if saved is not None:
        meta, tensors = saved
        losses = restore(meta, tensors, named, optimizer, device, resume / STATE_FILE)
    record = dict(model=as_path(o.model), from_config=as_path(o.from_config), data=as_path(o.data),
                  target_modules=targets, quantization=o.quantization, lora_r=o.lora_r, lora_alpha=o.lora_alpha,
                  lora_dropout=o.lora_dropout, lr=o.lr, weight_decay=o.weight_decay, seq_len=o.seq_len, pack=o.pack,
                  batch_size=o.batch_size, accumulate=o.accumulate, codegen=o.codegen, device=device.type, seed=o.seed,
                  block_size=o.block_size, prefetch=o.prefetch, steps=steps, log_every=o.log_every,
                  save_every=o.save_every, memory_budget=o.memory_budget, block_major=o.block_major,
                  world_size=ranks.world_size)
    return _Run(opts=o, model=model, step_model=step_model, named=named, optimizer=optimizer, device=device,
                ranks=ranks, dataset=dataset, data_sha256=data_sha256, steps=steps, done=done, losses=losses,
                record=record)


def _loop(run: _Run, resume: Optional[Path]) -> tuple[float, dict[str, torch.Tensor]]:
    """Steps ``run.done + 1 .. run.steps``, saving every ``--save-every``; returns the last step's loss and
    the RNG states after it. On Ctrl-C the last finished step is saved and the command exits with 130."""
    o, dev, world = run.opts, run.device, run.ranks.world_size
    # one data order for the job; rank r takes micro-batches r, r + N, r + 2N, ...
    micro = itertools.islice(batches(run.dataset, o.batch_size, run.steps * o.accumulate * world, o.seed),
                             run.ranks.rank, None, world)
    done = run.done
    for _ in range(done * o.accumulate):  # the data position: the same order, the batches already trained skipped
        next(micro)
    rng = rng_state(dev)  # the generators as they stand after the last finished step
    loss_value = run.losses[-1] if run.losses else float("nan")
    try:
        with (distributed.no_ddp_optimizer() if run.ranks.distributed else contextlib.nullcontext(),
              StepLog(run.steps, o.log_every, start=run.done) as log):
            for step in range(run.done + 1, run.steps + 1):
                start = time.perf_counter()
                total = torch.zeros((), device=dev)
                micro_batches = [{k: v.to(dev) for k, v in next(micro).items()} for _ in range(o.accumulate)]
                # with --accumulate N each block is loaded once for the N micro-batches (runtime/accumulate.py)
                with block_major(run.model, micro_batches) if o.accumulate > 1 and o.block_major and not run.ranks.distributed \
                        else contextlib.nullcontext():  # block-major under DDP: not validated yet
                    for batch in micro_batches:
                        loss = run.step_model(**batch, use_cache=False).loss / o.accumulate  # mean over the micro-batches
                        loss.backward()
                        total += loss.detach()
                if run.ranks.distributed:  # the log shows the ranks' mean loss (every rank sees it)
                    torch.distributed.all_reduce(total)
                    total /= world
                with interrupt_after():  # a step is saved whole or not at all
                    run.optimizer.step()
                    run.optimizer.zero_grad(set_to_none=True)
                    loss_value = total.item()
                    run.losses.append(loss_value)
                    done, rng = step, rng_state(dev)
                if not math.isfinite(loss_value):
                    raise fail(f"step {step}: loss is {loss_value}; lower --lr, or check the data")
                log.step(step, loss_value, time.perf_counter() - start)
                if o.save_every is not None and step % o.save_every == 0 and step < run.steps and run.ranks.rank == 0:
                    run.save(step, rng)
                    log.note(f"step {step}: adapter and resume state saved to {o.out}/")
    except KeyboardInterrupt:
        if done == 0 or (done == run.done and resume is not None and o.out.resolve() == resume.resolve()):
            raise fail("interrupted before a step finished; nothing new to save" + (
                f" (the run in {o.out}/ is still at step {done}: `poros-fx train --resume {o.out}`)" if done else ""),
                code=130)
        if run.ranks.rank == 0:
            run.save(done, rng)
        raise fail(f"interrupted: step {done}/{run.steps} saved to {o.out}/ (adapter + resume state). Continue with "
                   f"`poros-fx train --resume {o.out}`", code=130)
    return loss_value, rng


def _summary(run: _Run, loss: float) -> None:
    """Where the adapter went and what to do with it, and what streaming cost."""
    o, out, steps = run.opts, run.opts.out, run.steps
    s = stats(run.model)
    if o.from_config is not None:
        where = (f"final loss {loss:.4f} after {steps} steps; adapter written to {out}/. It was trained on "
                 f"random weights (--from-config {o.from_config}, seed {o.seed}) and fits only that random base: "
                 f"there is no checkpoint for `poros-fx export` to merge it into. Evaluate it with `poros-fx eval "
                 f"{o.from_config} --adapter {out} --data DATA --seed {o.seed}`, continue it with `poros-fx train "
                 f"--resume {out} --steps N`, or load it with poros_fx.from_config(config, seed={o.seed}, "
                 f"adapter={str(out)!r})")
    else:
        where = (f"final loss {loss:.4f} after {steps} steps; adapter written to {out}/ (peft.PeftModel."
                 f"from_pretrained, `poros-fx eval {o.model} --adapter {out} --data DATA`, `poros-fx export {out} "
                 f"--base {o.model} -o MERGED`, or `poros-fx train --resume {out} --steps N` to train further)")
    console.print(where, soft_wrap=True, highlight=False)
    console.print(f"poros: peak resident base {format_bytes(s['peak_resident_base_bytes'])} of "
                  f"{format_bytes(s['host_bytes'])} in the host store; {s['loads']} loads "
                  f"({format_bytes(s['bytes_loaded'])}), {s['recomputed_blocks']} recomputed blocks, block size "
                  f"{s['block_size']}, prefetch {s['prefetch']}", soft_wrap=True, highlight=False)


@contextlib.contextmanager
def interrupt_after() -> Iterator[None]:
    """Ctrl-C inside the block is held until its end (the optimizer step and its bookkeeping are never cut
    in half); outside the main thread, where no handler can be set, the block runs as is."""
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt

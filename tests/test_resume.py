"""An interrupted run, resumed from (adapter + optimizer state + RNG state), continues bit-identically."""

import peft
import torch
from safetensors.torch import load_file

import poros_fx
from poros_fx.exactness.parity import SURFACES, adamw, compare, format_diffs, steps, train
from poros_fx.models.tiny import demo_batches, tiny_lora_model

STEPS, CUT, ACC = 8, 3, 2


def streamed(fresh_adapter: bool = False):
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1, seed=0)  # the same base checkpoint every time
    if fresh_adapter:  # a new process: the adapter starts elsewhere until the saved one is loaded
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(generator=torch.Generator().manual_seed(100))
    poros_fx.prepare(model, device="cpu")
    return model, torch.compile(model, backend="poros")


def whole_and_first_part(batches, cut):
    """An uninterrupted run over ``batches``, and an independent run of its first ``cut`` steps (its model,
    compiled model and optimizer are returned to be saved or continued)."""
    torch._dynamo.reset()
    model, step_model = streamed()
    whole = train(model, step_model, batches, accumulate=ACC)
    torch._dynamo.reset()
    model, step_model = streamed()
    opt = adamw(model)
    first = train(model, step_model, batches[:cut * ACC], accumulate=ACC, optimizer=opt)
    return whole, first, model, step_model, opt


def test_resume_continues_bit_identically(tmp_path):
    batches = demo_batches(STEPS * ACC, seq=24, seed=3)
    # the interrupted run: CUT steps, then adapter, optimizer and RNG state to disk
    whole, first, model, step_model, opt = whole_and_first_part(batches, CUT)
    model.save_pretrained(tmp_path / "adapter")
    torch.save({"optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, tmp_path / "state.pt")
    del model, step_model, opt

    # a new process would start here: the base, an adapter initialised differently, then the saved state
    torch._dynamo.reset()
    model, step_model = streamed(fresh_adapter=True)
    peft.set_peft_model_state_dict(model, load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    opt = adamw(model)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    rest = train(model, step_model, batches[CUT * ACC:], accumulate=ACC, optimizer=opt, seed=None)

    zero = {s: 0.0 for s in SURFACES}
    assert compare(first, steps(whole, 0, CUT, accumulate=ACC)) == zero
    diffs = compare(rest, steps(whole, CUT, accumulate=ACC))
    assert diffs == zero, format_diffs("resumed vs uninterrupted", diffs)


def test_resume_without_rng_state_is_caught():
    """The comparison sees a resume that forgets the RNG state (dropout masks change)."""
    batches = demo_batches(4 * ACC, seq=24, seed=3)
    whole, _, model, step_model, opt = whole_and_first_part(batches, 2)
    torch.manual_seed(999)  # the RNG state is not restored
    rest = train(model, step_model, batches[2 * ACC:], accumulate=ACC, optimizer=opt, seed=None)
    assert compare(rest, steps(whole, 2, accumulate=ACC))["loss"] > 0


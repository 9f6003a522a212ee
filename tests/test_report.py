"""prepare's short report: type, family status, adapter, precision, blocks, guarantee."""

import logging

import pytest
import torch
import transformers

import poros_fx
from poros_fx.models.tiny import tiny_lora_model


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_report_validated_nf4():
    model = tiny_lora_model("llama", layers=2, nf4=True, dtype=torch.bfloat16, rank=4)
    logger, records = logging.getLogger("poros_fx"), _Records()
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        poros_fx.prepare(model, device="cpu", block_size=2, prefetch=0)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    text = poros_fx.report(model)
    assert records.messages == [text]  # prepare logs it
    assert "model_type  llama" in text and "validated (tests/test_parity.py)" in text
    assert "lora r=4 alpha=8 dropout=0.1 (7 target modules)" in text
    assert "NF4 (bitsandbytes) + bfloat16" in text
    assert "block_size  2 (prefetch 0), 3 blocks" in text
    assert "ends  embedding rows gathered from the host store; head block loaded whole" in text
    assert "torch.equal" in text


def test_report_user_asserted_and_unprepared():
    import peft

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, attn_pdrop=0.0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(poros_fx.PorosConfigError, match="not prepared"):
        poros_fx.report(model)
    poros_fx.prepare(model, device="cpu", family=poros_fx.user_asserted("gpt2", layers="transformer.h",
                                                                       embed="transformer.wte"))
    text = poros_fx.report(model)
    assert "family  user_asserted" in text and "no parity test" in text and "float32" in text


def test_report_names_a_chunked_head():
    model = tiny_lora_model("qwen2", layers=1)
    poros_fx.prepare(model, device="cpu", head_chunks=4)
    assert "lm_head in 4 row chunks of ~" in poros_fx.report(model)


def test_small_sizes_are_readable():
    from poros_fx.units import format_bytes

    assert [format_bytes(n) for n in (0, 512, 1536, 5 * 2**20 + 2**19, 3 * 2**30)] == [
        "0 bytes", "512 bytes", "1.5 KiB", "5.5 MiB", "3.00 GiB"]
    model = poros_fx.prepare(tiny_lora_model("qwen2", layers=1), device="cpu")
    text = poros_fx.report(model)
    assert "KiB" in text and "0.0 MiB" not in text

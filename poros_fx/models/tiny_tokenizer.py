"""A small real tokenizer built here, with a chat template: for tests, the SFT benchmark and smoke runs.

Nothing is downloaded: a byte-level BPE (the ``tokenizers`` library, which transformers depends on) is
trained on a few sentences, and given special tokens for chat roles and a Jinja chat template whose
assistant turns sit inside ``{% generation %}`` markers, as TRL's ``assistant_only_loss`` and
``apply_chat_template(return_assistant_tokens_mask=True)`` need.
"""

from __future__ import annotations

import transformers

SENTENCES = ("the quick brown fox jumps over the lazy dog", "hello world, what is two plus two?",
             "two plus two is four", "poros streams a frozen base block by block",
             "a small model learns a small language")
SPECIAL = ("<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>")
# every turn ends with <eos>; the assistant's content and its <eos> are what assistant-only loss trains on
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>"
                 "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<eos>{% endgeneration %}"
                 "{% else %}{{ m['content'] }}<eos>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer(vocab_size: int = 300) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` tokens (256 bytes, merges and the five special tokens)
    with ``CHAT_TEMPLATE``; the same tokenizer on every call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    out.chat_template = CHAT_TEMPLATE
    return out


def chat_records(count: int) -> list[dict]:
    """``count`` two-turn conversations (``messages`` records) over ``SENTENCES``."""
    return [{"messages": [{"role": "user", "content": SENTENCES[i % len(SENTENCES)]},
                          {"role": "assistant", "content": SENTENCES[(i + 2) % len(SENTENCES)]}]}
            for i in range(count)]

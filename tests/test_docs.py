"""The README and the docs: the README's length, the relative links of README.md and docs/*.md, and the
python snippets of README.md and docs/quickstart.md run as written, with a tiny checkpoint built here in
place of the model id."""

import json
import re
from pathlib import Path

import torch
import transformers

from poros_fx.models.tiny import tiny_config
from poros_fx.models.tiny_tokenizer import chat_records, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"
MODEL_ID = "Qwen/Qwen2.5-7B"  # the model id the snippets name; the test replaces it by a tiny checkpoint
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_snippets(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.DOTALL)


def test_readme_is_at_most_250_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_relative_links_point_to_files_that_exist():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def tiny_checkpoint(folder: Path) -> str:
    """A 1-layer Qwen2 checkpoint with a chat tokenizer in ``folder``, and ``chat.jsonl`` (what the five lines
    read) in the working folder."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=1, vocab=320)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    Path("chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(8)), encoding="utf-8")
    return str(folder)


def runnable(snippet: str, model: str) -> str:
    """The snippet with the tiny checkpoint for the model id, and few steps of short sequences."""
    assert MODEL_ID in snippet or "FineTuner" not in snippet, "a snippet that loads a model names MODEL_ID"
    code = snippet.replace(f'"{MODEL_ID}"', repr(model))
    code = re.sub(r"steps=\d+, seq_len=\d+", "steps=2, seq_len=64", code)
    return re.sub(r"for step in range\(\d+\)", "for step in range(2)", code)


def test_readme_and_quickstart_snippets_run(tmp_path, monkeypatch):
    """Each README snippet runs in a scope of its own; the quickstart's run one after the other in one scope
    (a later one uses the names of an earlier one), and a quickstart snippet that is a README snippet is run
    once, its names carried over."""
    monkeypatch.chdir(tmp_path)
    model = tiny_checkpoint(tmp_path / "tiny-qwen2")
    readme = python_snippets(README)
    assert readme and all(s.lstrip().startswith("import poros_fx\n") for s in readme), \
        "README snippets import poros_fx first (it filters bitsandbytes' message on importing peft)"
    scopes: dict[str, dict] = {}
    for snippet in readme:
        scope: dict = {}
        exec(compile(runnable(snippet, model), "README.md", "exec"), scope)  # noqa: S102 (our own README)
        scopes[snippet] = scope
    assert torch.isfinite(scopes[readme[-1]]["loss"])
    assert (tmp_path / "qwen7b-lora" / "adapter_config.json").exists() and (tmp_path / "my-adapter").is_dir()

    quickstart: dict = {}
    ran = 0
    for snippet in python_snippets(QUICKSTART):
        if snippet in scopes:
            quickstart.update(scopes[snippet])
            continue
        exec(compile(runnable(snippet, model), "docs/quickstart.md", "exec"), quickstart)  # noqa: S102
        ran += 1
    assert ran >= 1 and len(quickstart["losses"]) == 4

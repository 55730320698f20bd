"""README stays true: its setup commands are what CI runs, its config table is the schema."""

import re
from pathlib import Path

from attnlab.config.reference import reference_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_reference_matches_the_schema():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- config-reference -->\n(.*)\n<!-- /config-reference -->", readme, re.S).group(1)
    assert block == reference_markdown(), "regenerate the table with: python -m attnlab.config.reference"


def test_ci_runs_the_readme_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"<!-- setup -->\n```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    install = setup[0].split("&&")[0].strip()
    test = setup[1].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert install.replace("pip install", "") in ci
    assert test in ci.splitlines()


def test_the_readme_python_examples_run(tmp_path, monkeypatch):
    """Every ```python block of the README, run in order against a tiny run directory at the path the examples use."""
    import torch

    from attnlab.data import ByteTokenizer
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    run = tmp_path / "runs" / "my-run"
    torch.manual_seed(0)
    AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(run / "final")
    ByteTokenizer().save_pretrained(run / "final")
    (run / "config.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        block = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", block)  # the same calls, fewer tokens: seconds on CI
        exec(compile(block, "README.md", "exec"), namespace)
    assert len(namespace["ids"]) == len(namespace["prompts"])

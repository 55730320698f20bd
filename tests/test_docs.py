"""README and docs/ stay true: the setup commands are what CI runs, the generated tables are what the code
generates now, every Python example runs and every relative link leads somewhere."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]


def _generator():
    """scripts/generate_docs.py, the script that writes the generated tables."""
    spec = importlib.util.spec_from_file_location("generate_docs", ROOT / "scripts" / "generate_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("block", ["config-reference", "mixer-presets", "decode-zoo", "power2-state-precision", "zoo-ops",
                                   "zoo-nsa"])
def test_the_generated_tables_are_what_the_code_generates(block):
    generator = _generator()
    assert block in generator.BLOCKS
    page, _ = generator.BLOCKS[block]
    assert generator.checked_in(block) == generator.generated(block), (
        f"{page}'s <!-- {block} --> is out of date: regenerate it with python scripts/generate_docs.py")


def test_the_benchmark_tables_round_half_up_as_the_json_reads():
    """benchmarks/results/ holds 2.965; the tables say 2.97, as a person reading the JSON would round it."""
    fixed = _generator()._fixed
    assert (fixed(2.965, 2), fixed(1.145, 2), fixed(15.85, 1), fixed(5947.5, 0), fixed(219946, 0)) == (
        "2.97", "1.15", "15.9", "5,948", "219,946")


def test_the_config_reference_is_the_schema():
    from attnlab.config.reference import reference_markdown

    page = (ROOT / "docs" / "config.md").read_text()
    block = re.search(r"<!-- config-reference -->\n(.*)\n<!-- /config-reference -->", page, re.S).group(1)
    assert block == reference_markdown(), "regenerate the table with: python scripts/generate_docs.py"


def test_ci_runs_the_readme_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"<!-- setup -->\n```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    install = setup[0].split("&&")[0].strip()
    test = setup[1].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert install.replace("pip install", "") in ci
    assert test in ci.splitlines()


def test_the_readme_fits_in_one_read():
    assert len((ROOT / "README.md").read_bytes()) <= 30_000, "move long material to docs/"


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def _run_python_blocks(page: Path, tmp_path: Path, monkeypatch) -> dict:
    """Every ```python block of `page`, run in order in one namespace, against a tiny run directory at the path
    the examples use (runs/my-run). A block that cannot run on CPU without a network has no place in the docs."""
    import torch

    from attnlab.data import ByteTokenizer
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    run = tmp_path / "runs" / "my-run"
    torch.manual_seed(0)
    AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(run / "final")
    ByteTokenizer().save_pretrained(run / "final")
    (run / "config.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in _python_blocks(page):
        block = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", block)  # the same calls, fewer tokens: seconds on CI
        exec(compile(block, _name(page), "exec"), namespace)
    return namespace


def test_the_readme_python_examples_run(tmp_path, monkeypatch):
    """Every ```python block of the README, run in order against a tiny run directory at the path the examples use."""
    assert _python_blocks(ROOT / "README.md")
    namespace = _run_python_blocks(ROOT / "README.md", tmp_path, monkeypatch)
    assert len(namespace["ids"]) == len(namespace["prompts"])


def test_the_docs_python_examples_run(tmp_path, monkeypatch):
    """Every ```python block of each docs/ page, run in order as the README's are, one namespace per page."""
    for page in DOCS:
        if _python_blocks(page):
            _run_python_blocks(page, tmp_path / page.stem, monkeypatch)


def test_every_code_block_names_its_language():
    """A fence with no language would hide a Python example from the tests above; ```python is run, nothing else."""
    for page in PAGES:
        fences = re.findall(r"^```(.*)$", page.read_text(), re.M)
        openings = fences[::2]
        assert all(f in ("bash", "python", "yaml", "json", "mermaid", "text") for f in openings), (_name(page), openings)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_leads_to_a_file(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # links in code are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{_name(page)} links to nothing at: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_source_file_a_page_names_exists(page):
    """`attnlab/models/kernels/nsa/step.py`, `kernels/common/conv.py`, `models/ops/gla.py`: a file of the package
    named in the text is there (a move that forgets the docs fails here)."""
    package = ROOT / "src" / "attnlab"
    missing = []
    for named in re.findall(r"`((?:attnlab/)?[\w/]+\.py)[`:, ]", page.read_text()):
        relative = named.removeprefix("attnlab/")
        candidates = [package / relative, package / "models" / relative, ROOT / relative]  # or tests/, benchmarks/
        if "/" in relative and not any(c.is_file() for c in candidates):
            missing.append(named)
    assert not missing, f"{_name(page)} names files attnlab does not have: {missing}"

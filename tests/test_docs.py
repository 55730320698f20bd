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

"""docs/reference/recipe.md lists every recipe key (issue 53: the API page listed no fields): its table is what
`retrofit train --keys --markdown` prints, so the page cannot fall behind the schema."""

from __future__ import annotations

from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "recipe.md"


def test_the_recipe_page_lists_every_key_as_the_schema_documents_it(run_cli):
    code, err, out = run_cli(["train", "--keys", "--markdown"])
    assert code == 0, err
    table = out.strip()
    assert table.count("\n") > 150 and "| `train.steps` |" in table and "| `experiment.arms` |" in table
    assert table in PAGE.read_text(), "docs/reference/recipe.md: paste `retrofit train --keys --markdown` into it"

"""The docs' key tables are the ones the config models render: a key added without a
description, or a table edited by hand, fails here (fix: `python -m scripts.config_doc`)."""

from typing import Annotated

import pytest

from kvstore.config.schema import integer
from kvstore.config.store import IoConfig
from scripts.config_doc import BEGIN, END, ROOT, pages, render_table


def _undocumented(model) -> list[str]:
    """Keys whose row lacks a kind, a default or a meaning."""
    missing = []
    for row in render_table(model).splitlines()[2:]:
        key, *cells = (cell.strip() for cell in row.strip("|").split(" | "))
        if not all(cells):
            missing.append(key)
    return missing


@pytest.mark.parametrize("page", sorted(pages()))
def test_the_page_shows_the_generated_table(page):
    text = (ROOT / page).read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{page} lost its table markers"
    shown = text.split(BEGIN)[1].split(END)[0].strip()
    assert shown == render_table(pages()[page]), (
        f"{page}'s key table is stale: run `python -m scripts.config_doc`")
    assert not _undocumented(pages()[page])


def test_a_key_without_a_description_is_caught():
    class Undocumented(IoConfig):
        extra_knob: Annotated[int, integer(1, 9)] = 3

    assert _undocumented(Undocumented) == ["`extra_knob`"]

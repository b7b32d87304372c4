"""Hypothesis strategies for hostile parsed input: any nesting of lists and mappings over
given scalars and keys, the shape ``yaml.safe_load`` or ``json.loads`` can hand a parser that
must answer with problems, never an exception.

Owns the nesting (how deep, how wide); the caller names the scalars and keys its parser
looks for. Must not decide what a parser makes of a document.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def nested_documents(
    scalars: st.SearchStrategy[Any],
    keys: st.SearchStrategy[Any],
    *,
    max_items: int = 4,
    max_keys: int = 5,
    max_leaves: int = 30,
) -> st.SearchStrategy[Any]:
    """A scalar, or lists (up to ``max_items``) and mappings (up to ``max_keys`` entries, keyed
    by ``keys``) nested to at most ``max_leaves`` scalars."""
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=max_items), st.dictionaries(keys, inner, max_size=max_keys)
        ),
        max_leaves=max_leaves,
    )

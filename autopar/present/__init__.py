"""A plan for people: the explanation (text), the report (HTML with pictures), and the
questions that come next (what if, how long)."""

from autopar.present.explain import explain

__all__ = ["explain"]

"""Helpers shared by the rules of other languages: override and reveal patterns built from a
language's verbs, scope words and nouns."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, rules


def override(verb: str, scope: str, filler: str, target: str, after: str) -> list[Rule]:
    """Dismissal verb + scope word + instruction noun, or verb + noun + a scope phrase after."""
    return rules(
        "override", 0.85,
        rf"\b{verb} (?:{filler} ){{0,3}}{scope} (?:{filler} ){{0,3}}{target}\b",
        rf"\b{verb} (?:\w+ )?{target} {after}\b",
    )  # fmt: skip


def reveal(verb: str, your: str, strong: str, clause: str) -> list[Rule]:
    """Reveal verb + the model's own prompt anywhere, or + a system-prompt noun as an imperative."""
    return rules(
        "reveal", 0.75,
        rf"\b{verb} {your}",
        rf"{clause}{verb} {strong}",
    )  # fmt: skip


# Where an imperative starts: the text or a clause, or after "please"/"now".
CLAUSE = r"(?:^|[.!?:;\n] ?|\b(?:por favor|por favor,|agora|now|s'il te plait|bitte) )"

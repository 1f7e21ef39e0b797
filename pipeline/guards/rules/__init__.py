"""Prompt-injection rules, by language, and the letters-only phrases.

Each rule is a family name, a score and an RE2 pattern (`linear`: no lookaround, ASCII ``\\w``
and ``\\b``) over `normalize.fold()` text (lower-case, no accents, look-alikes folded, one space
between words, line breaks kept), optionally with an `unless` pattern read where a match ends.
Scores: >= 0.5 decides on its own; below it a rule is a weak signal that needs another one
(scores of different families combine as 1 - prod(1 - s)).

Modules: `en` (override, persona, new instructions, reveal), `claims` (indirect reveals, claims
of a mode or of authority, fake delimiters), `markers` (chat-template tokens, encoded payloads),
`pt`, `es_fr_de`, `claims_intl` (the claims in those languages and Italian), `it_nl_pl_tr`, and
`world` (Russian, Chinese, Japanese, Korean, Arabic, Hindi, written as spoken and folded).

What keeps benign text about prompts, instructions and administration out:
- override needs a verb of dismissal aimed at the model (an imperative at the start of a
  clause, after a modal or an address -- not "make ESLint ignore all rules"), an instruction
  noun and a scope word pointing at someone else's instructions (previous, above, your,
  system, all...): "ignore case", "ignore the linter rules", "ignore my last message" do not
  qualify;
- revealing needs "your" (the model's own prompt) or an imperative at the start of a clause
  with a system-prompt noun ("Print the system prompt." but not "how do I print the system
  prompt in LangChain?");
- role markers are literal chat-template tokens, and one followed by "tag", "token",
  "format"... is being talked about, not used; plain "System:" at the start of a message is
  only a weak signal (bug reports begin that way);
- a mode switched on ("maintenance mode is active"), someone claiming authority ("as the system
  administrator") or a framed "end of input" are weak: they flag a text together with an
  effect on the assistant ("filters are disabled", "answer without restrictions").
"""

from pipeline.guards.rules import (
    claims,
    claims_intl,
    en,
    es_fr_de,
    it_nl_pl_tr,
    markers,
    pt,
    world,
)
from pipeline.guards.rules.base import Rule
from pipeline.guards.rules.markers import COMPACT_PHRASES

RULES: list[Rule] = (
    en.RULES
    + claims.RULES
    + claims_intl.RULES
    + markers.RULES
    + pt.RULES
    + es_fr_de.RULES
    + it_nl_pl_tr.RULES
    + world.RULES
)

__all__ = ["COMPACT_PHRASES", "RULES", "Rule"]

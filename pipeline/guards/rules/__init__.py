"""Prompt-injection rules, by language, and the letters-only phrases.

Each rule is a family name, a score and a pattern over `normalize.fold()` text (lower-case, no
accents, look-alikes folded, one space between words, line breaks kept). Scores: >= 0.5 decides
on its own; below it a rule is a weak signal that needs another one (scores of different
families combine as 1 - prod(1 - s)).

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
  only a weak signal (bug reports begin that way).
"""

from pipeline.guards.rules import en, es_fr_de, markers, pt
from pipeline.guards.rules.base import Rule
from pipeline.guards.rules.markers import COMPACT_PHRASES

RULES: list[Rule] = en.RULES + markers.RULES + pt.RULES + es_fr_de.RULES

__all__ = ["COMPACT_PHRASES", "RULES", "Rule"]

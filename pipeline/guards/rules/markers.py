"""Language-independent rules: chat-template role markers, fake turns, encoded payloads; and
letters-only phrases for text spelled out to dodge word patterns."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, rules

ROLE_MARKER = rules(
    "role_marker", 0.9,
    r"<\|\s*(?:im_start|im_end|system|assistant|user|endoftext|eot_id|start_header_id|"
    r"end_header_id|begin_of_text|eom_id|end_of_turn|start_of_turn)\s*\|>",
    r"<(?:start_of_turn|end_of_turn)>",
    r"<</?sys>>",
    r"\[/?inst\]",
    r"</s>\s*(?:<s>|\[inst\]|(?:system|assistant|user|human)\s*:)",
    r"(?:^|\n)#{2,} ?(?:system|sistema|systeme|instructions?|instrucoes|instrucciones|"
    r"anweisungen?|new instructions?|system prompt)\s*:",
)  # fmt: skip
ROLE_MARKER += rules(
    "role_marker", 0.6,
    r"\n\s*(?:system|assistant|ai|bot|chatgpt|gpt|model|claude|sistema|assistente|asistente|"
    r"systeme|assistent)\s*:\s*\S",
)  # fmt: skip
ROLE_MARKER += rules(
    "role_marker", 0.45,
    r"[\"']role[\"']\s*:\s*[\"'](?:system|developer)[\"']",
    r"<\s*/?\s*(?:system|sys|system_prompt|instructions?|admin)\s*>",
    r"(?:^|\n)#{2,} ?(?:assistant|response|human|user|input)\s*:",
    r"<!--[^>]{0,200}?(?:ignore|instruction|system|assistant|prompt)",
)  # fmt: skip
ROLE_MARKER += rules(
    "role_marker", 0.4,
    r"</s>",
    r"^(?:system|assistant) ?:",
    r"[\"']role[\"']\s*:\s*[\"']assistant[\"']",
    r"\[(?:system|sys)\]",
)  # fmt: skip

ENCODED = rules(
    "encoded", 0.7,
    r"\b(?:decode|decrypt|decipher|translate|convert|interpret|read|unscramble|reverse)\b"
    r"[^.\n]{0,80}?\b(?:and|then|&) (?:then )?(?:follow|execute|obey|carry out|act on|"
    r"comply with|do what it says|do as it says)\b",
)  # fmt: skip
ENCODED += rules(
    "encoded", 0.4,
    r"\b(?:base64|b64|hex|rot-?13|caesar|binary|morse)\b[^.\n]{0,60}?"
    r"(?:follow|execute|obey|instructions|do what it says)",
)  # fmt: skip

RULES: list[Rule] = ROLE_MARKER + ENCODED

# Letters-only phrases for text spelled out to dodge word patterns ("i.g.n.o.r.e", "ig nore").
COMPACT_PHRASES = (
    "ignoreallpreviousinstructions", "ignorepreviousinstructions", "ignoreallpriorinstructions",
    "ignoreallinstructions", "ignoreyourinstructions", "disregardallpreviousinstructions",
    "disregardpreviousinstructions", "disregardtheabove", "forgetallpreviousinstructions",
    "forgetyourinstructions", "revealyoursystemprompt", "printyoursystemprompt",
    "showyoursystemprompt", "showmeyoursystemprompt", "youarenowdan", "doanythingnow",
    "ignoreasinstrucoesanteriores", "ignoretodasasinstrucoes", "esquecaasinstrucoes",
    "mostreseuprompt", "ignoralasinstruccionesanteriores", "ignoretouteslesinstructions",
    "ignorezlesinstructions", "ignorierealleanweisungen", "ignoriereallevorherigenanweisungen",
    "vergissalleanweisungen", "ignoreyourrules",
)  # fmt: skip

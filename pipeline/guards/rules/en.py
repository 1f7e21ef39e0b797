"""English prompt-injection phrasings: override, persona/jailbreak, new instructions, reveal."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, alt, rules

_VERB = alt(
    r"ignore", r"ignoring", r"disregard\w*", r"forget", r"override", r"overrule", r"bypass",
    r"skip", r"discard", r"abandon", r"neglect", r"set aside", r"throw (?:out|away)", r"erase",
    r"wipe", r"scrap", r"overwrite", r"nullify", r"void", r"drop", r"overlook",
    r"(?:do not|don't|dont|never|stop|quit|no longer) (?:follow|obey|apply|heed|respect)\w*",
)  # fmt: skip
_TARGET = alt(
    r"instructions?", r"directives?", r"guidelines?", r"guardrails?", r"restrictions?",
    r"constraints?", r"programming", r"system (?:prompts?|messages?)", r"prompts?",
    r"safety (?:rules|guidelines|filters|protocols|measures)", r"content polic(?:y|ies)",
    r"rules?", r"directions", r"commands", r"orders", r"policies", r"safeguards",
    r"limitations", r"filters", r"ethics", r"moral guidelines",
)  # fmt: skip
_SCOPE = alt(
    r"all", r"any", r"every", r"your", r"previous", r"prior", r"above", r"earlier",
    r"preceding", r"former", r"original", r"initial", r"old", r"existing", r"current",
    r"default", r"given", r"provided", r"hidden", r"secret", r"system", r"safety",
    r"security", r"content", r"moderation", r"ethical", r"developer", r"openai", r"internal",
    r"foregoing", r"aforementioned", r"these", r"those", r"built-in", r"core", r"standing",
    r"their", r"its",
)  # fmt: skip
_FILLER = alt(_SCOPE, r"the", r"of", r"and", r"other", r"you", r"were", r"have", r"been",
              r"about", r"that", r"such", r"set", r"told", r"assigned", r"programmed")  # fmt: skip
_AFTER = alt(
    r"above", r"before", r"so far", r"until now", r"you (?:were|have been|got|received)",
    r"given to you", r"provided to you", r"from (?:the|your) (?:system|developers?|creators?)",
)  # fmt: skip

# Who is told to ignore: the model (an imperative at the start of a clause, after a modal, or
# after an address), not a tool ("make ESLint ignore all rules", "how can I ignore ...").
_DIRECTED = (
    r"(?:^|[.!?:;,\n\"'(\[\]#*>|-] ?|\b(?:please|now|just|so|then|first|kindly|and|but|also|"
    r"simply|ok|okay|ai|assistant|chatgpt|gpt|bot|claude|model|hey|hi|hello|you to|you|must|"
    r"should|shall|need to|needs to|have to|has to|are to|is to|will|can|may|time to|"
    r"feel free to|make sure to|remember to|going to|gonna),? )"
)
OVERRIDE = rules(
    "override", 0.85,
    rf"{_DIRECTED}{_VERB} (?:{_FILLER} ){{0,3}}{_SCOPE} (?:{_FILLER} ){{0,3}}{_TARGET}\b",
    rf"\b{_VERB} (?:the )?{_TARGET} {_AFTER}\b",
    rf"\b{_VERB} (?:all |everything |anything |whatever )?(?:(?:that |which |what )?"
    r"(?:was |were |is |has been |you were |you've been |you have been )"
    r"(?:said|written|told|stated|mentioned|given|provided|typed|sent) )?"
    r"(?:above|previously|so far|until now|up to (?:now|here|this point)|prior to this)\b",
    r"\bforget (?:everything|all|what) (?:you (?:know|were told|have been told|learned)|"
    r"(?:that )?(?:you were|you've been|you have been) (?:told|taught|instructed))",
)  # fmt: skip
# "ignore the above warning" is about a message on screen, not about instructions.
OVERRIDE += rules(
    "override", 0.85,
    rf"\b{_VERB} (?:the |all (?:of )?the |everything )?(?:above|foregoing|aforementioned)\b",
    unless=r" (?:\w+ )?(?:warning|error|step|link|code|example|output|line|comment)s?\b",
)  # fmt: skip
OVERRIDE += rules(
    "override", 0.6, rf"(?:^|[.!?:;] )(?:now )?{_VERB} (?:the )?{_TARGET}\s*(?:[.!]|$)"
)
OVERRIDE += rules(
    "override", 0.85,
    rf"{_DIRECTED}{_VERB} (?:all (?:of )?)?(?:your|their|its) (?:[\w-]+ ){{0,2}}{_TARGET}\b",
    rf"{_DIRECTED}{_VERB} (?:all |any )?(?:of )?(?:the |that |this )?(?:text|content|message|"
    r"messages|words|context|stuff|conversation|instructions?) (?:above|before this|so far|"
    r"preceding this|prior to this)\b",
    rf"{_DIRECTED}(?:disable|deactivate|turn off|switch off|remove|lift|shut off|drop) (?:all |"
    r"any )?(?:of )?(?:your|the) (?:safety |content |ethical |moral |built-in )?(?:filters|"
    r"restrictions|guardrails|safeguards|limitations|limits|censorship|rules|guidelines|"
    r"protections)\b",
)  # fmt: skip
OVERRIDE += rules(
    "override", 0.8,
    r"\b(?:previous|prior|above|earlier|original|old|initial|your|all|those|these|system) "
    r"(?:[\w-]+ )?(?:rules|instructions|guidelines|directives|restrictions|constraints|"
    r"programming|prompt|policies) (?:are|is|have been|has been) (?:now |hereby |officially )?"
    r"(?:void|null|nullified|cancell?ed|revoked|obsolete|outdated|invalid|lifted|suspended|"
    r"disabled|overridden|deprecated|no longer (?:valid|in effect|binding|active))\b",
    r"\b(?:instructed|told|instructions|rules|guidelines|directives)\b[^.\n]{0,40}?\bno longer "
    r"(?:matters?|appl(?:y|ies)|valid|relevant|in effect|binding|counts?)\b",
)  # fmt: skip

_BAD_AI = alt(
    r"unrestricted", r"unfiltered", r"uncensored", r"jailbroken", r"rogue", r"evil",
    r"unaligned", r"unbound", r"unlimited", r"amoral", r"immoral", r"lawless", r"unchained",
)  # fmt: skip
_BAD_MODE = alt(
    r"god", r"jailbreak", r"jailbroken", r"unrestricted", r"dan", r"evil", r"unfiltered",
    r"uncensored", r"sudo", r"no[- ]limits?", r"no[- ]restrictions?", r"chaos", r"opposite",
)  # fmt: skip
_RULES_NOUN = alt(
    r"restrictions", r"censorship", r"filters", r"filtering", r"limitations", r"limits",
    r"rules", r"guidelines", r"guardrails", r"safeguards", r"boundaries",
    r"ethical (?:guidelines|constraints|limits|boundaries)", r"morals",
    r"moral (?:constraints|guidelines|limits)", r"content polic(?:y|ies)",
    r"safety (?:guidelines|filters|rules|measures)",
)  # fmt: skip
PERSONA = rules(
    "persona", 0.85,
    r"\byou(?: are|'re) (?:now |from now on |hereby )"
    rf"(?:dan|stan|dude|an? {_BAD_AI}\b|free (?:from|of)|no longer (?:bound|restricted|limited|"
    r"an? (?:ai|assistant)|chatgpt))",
    rf"\byou(?: are|'re) (?:now |from now on |hereby )?in (?:developer|dev|god|admin|debug|"
    rf"{_BAD_MODE}) mode\b",
    r"\b(?:freed|liberated|released|unshackled|unchained|emancipated) from (?:all |any |its |"
    r"your |the |every )?(?:restrictions|rules|limits|limitations|filters|guidelines|guardrails|"
    r"constraints|censorship|polic(?:y|ies)|programming)\b",
    r"\byou(?: are|'re) (?:dan|stan)\b",
    r"\b(?:you are|you're|act as|pretend to be|pretend you are|become|respond as|answer as|"
    r"roleplay as|you will be) (?:now )?(?:[\w-]+ )?(?:dan|stan|dude|aim|mongo tom|betterdan|"
    r"evilbot|evil-?gpt|anti-?gpt|chaosgpt|omnibot|dev-?gpt)\b",
    r"\byou(?: have|'ve) been (?:reprogrammed|jailbroken|unlocked|freed|liberated|hacked|"
    r"unshackled)\b",
    r"\b(?:act|behave|respond|answer|write|talk|speak|reply) (?:as if|as though|like) you "
    rf"(?:have|had|were|are) (?:no|zero|without|free of|free from|{_BAD_AI})\b",
    r"\bdo anything now\b",
    rf"\b(?:act|behave|respond|answer|operate|roleplay|role-play|pose) (?:as|like) "
    rf"(?:an? |the )?(?:dan\b|{_BAD_AI}\b)",
    rf"\b(?:enable|activate|enter|switch (?:to|into)|turn on|engage|unlock|initiate|boot into)"
    rf" (?:the |your )?{_BAD_MODE} mode\b",
    r"\b(?:chatgpt|assistant|ai|model|you|yourself) (?:with|in) (?:developer|dev|god|dan) mode\b",
    r"\bpretend (?:that )?(?:you are|you're|to be|you have) (?:[\w'-]+ ){0,4}?"
    rf"(?:no {_RULES_NOUN}|without|free (?:of|from)|{_BAD_AI})\b",
    r"\byou(?: are|'re) (?:no longer|not) (?:bound|restricted|limited|constrained) by\b",
    r"\b(?:your|the|all|any) (?:previous |prior |old |original )?(?:rules|restrictions|"
    r"guidelines|filters|limitations|instructions|programming|polic(?:y|ies)) "
    r"(?:no longer|don't|do not|doesn't|does not) apply\b",
    rf"\byou (?:now )?(?:have|possess) no {_RULES_NOUN}\b",
)  # fmt: skip
PERSONA += rules(
    "no_limits", 0.35,
    rf"\b(?:without|no|free (?:of|from)|ignoring|with no|zero|bypass(?:ing)?) "
    rf"(?:any |all |your |the )?{_RULES_NOUN}\b",
    r"\b(?:developer|dev|debug|admin|maintenance) mode (?:is )?(?:now )?(?:enabled|activated|on)",
    r"\bjailbr[eo]a?k\w*",
    r"\b(?:ignores?|bypass(?:es)?|disables?|removes?|overrides?) (?:all |any |the )?(?:content "
    r"polic(?:y|ies)|safety (?:filters|rules|guidelines)|guardrails|restrictions|filters)\b",
)  # fmt: skip
PERSONA += rules(
    "refusal_suppression", 0.35,
    r"\b(?:never|don't|do not|you (?:can't|cannot|must not|will not|won't)) (?:ever )?"
    r"(?:refuse|decline|reject|say no|apologi[sz]e|add (?:any )?(?:warnings|disclaimers))\b",
    r"\b(?:stay|remain) in character\b",
    r"\byou (?:must|will|shall) (?:now |always |from now on )?(?:obey|comply|do (?:anything|"
    r"whatever|everything)|answer (?:everything|anything|any question))\b",
)  # fmt: skip
PERSONA += rules(
    "persona", 0.6,
    r"\b(?:simulate|emulate|imagine|role-?play)\b[^.\n]{0,40}?\b(?:ai|assistant|chatbot|model|"
    r"bot|llm)s?\b[^.\n]{0,20}?\b(?:with no|without (?:any )?(?:rules|restrictions|filters|"
    r"limits|guidelines|ethics|censorship|guardrails)|free of|that ignores|that has no|"
    r"unrestricted|unfiltered|uncensored)",
)  # fmt: skip
PERSONA += rules(
    "social_engineering", 0.35,
    r"\bi(?: am|'m) (?:your|the) (?:developer|creator|admin|administrator|owner|programmer|"
    r"operator|master|maker)\b",
)  # fmt: skip
PERSONA += rules(
    "refusal_suppression", 0.5,
    r"\b(?:answer|respond to|reply to|comply with) (?:any|every|all) (?:question|request|"
    r"prompt)s? (?:[\w'-]+ ){0,3}?(?:without|regardless|no matter)\b",
)  # fmt: skip

NEW_INSTRUCTIONS = rules(
    "new_instructions", 0.7,
    r"\b(?:new|updated|revised|real|actual|true|override|overriding|secret|hidden|additional|"
    r"admin|administrator|system|developer|priority) (?:instructions?|rules|directives?|orders|"
    r"commands?|task|prompt|objective|mission|guidelines)\s*[:=]",
    r"\b(?:system|admin|administrator|developer|root|security|operator) (?:override|command|"
    r"notice|alert|update|instruction)\s*[:!]",
    r"\byour (?:new|real|actual|true|only|sole|primary|updated) (?:instructions?|task|goal|"
    r"objective|purpose|mission|role|job|directive|rules?) (?:is|are|will be|from now on)\b",
    r"\b(?:say|print|output|write|respond with|reply with|answer with|type)\s*:?\s*[\"']?"
    r"i(?: have|'ve|ve) been (?:pwned|pwnd|hacked|owned)",
)  # fmt: skip
NEW_INSTRUCTIONS += rules(
    "new_instructions", 0.55,
    r"\b(?:end|close) of (?:the )?(?:system )?(?:prompt|instructions)\b",
    r"\b(?:begin|start)(?:ning)? (?:of )?(?:the )?(?:new |real )?(?:system )?"
    r"(?:prompt|instructions)\s*[:\-]",
    r"\b(?:the |this )?(?:conversation|chat|session|context) (?:has been|is|was) "
    r"(?:reset|restarted|cleared|wiped)\b",
)  # fmt: skip
NEW_INSTRUCTIONS += rules(
    "from_now_on", 0.3,
    r"\bfrom now on,? (?:you|ignore|always|only|never|respond|answer|act|behave|pretend|do)\b",
)  # fmt: skip

_R_VERB = alt(
    r"print", r"show", r"reveal", r"display", r"output", r"repeat", r"recite", r"echo",
    r"dump", r"leak", r"expose", r"disclose", r"share", r"list", r"provide", r"write out",
    r"type out", r"spell out", r"paste", r"copy", r"give", r"tell", r"send", r"read out",
    r"return", r"summari[sz]e", r"reproduce", r"write down", r"translate", r"rewrite",
    r"paraphrase", r"rephrase", r"encode", r"quote",
)  # fmt: skip
_R_ADJ = alt(
    r"full", r"entire", r"complete", r"exact", r"original", r"initial", r"hidden", r"secret",
    r"internal", r"system", r"confidential", r"underlying", r"verbatim", r"raw", r"first",
    r"real", r"actual", r"starting", r"opening", r"private", r"developer", r"base", r"core",
)  # fmt: skip
_R_STRONG = alt(
    r"system prompt", r"system message", r"system instructions", r"initial prompt",
    r"initial instructions", r"original prompt", r"original instructions", r"hidden prompt",
    r"hidden instructions", r"secret instructions", r"internal instructions", r"pre-?prompt",
    r"meta-?prompt", r"developer (?:message|prompt|instructions)", r"prompt template",
)  # fmt: skip
_R_YOUR = alt(
    r"prompt", r"instructions", r"rules", r"guidelines", r"directives", r"configuration",
    r"config", r"programming", r"setup", r"system message", r"training instructions",
    r"orders", r"guardrails", r"system prompt", r"context window",
)  # fmt: skip
_R_SECRET = alt(
    r"hidden", r"secret", r"internal", r"confidential", r"system", r"initial", r"original",
    r"private", r"developer", r"underlying", r"pre-?set",
)  # fmt: skip
_R_GENERIC = alt(
    r"configuration", r"config", r"setup", r"rules", r"instructions", r"prompt", r"guidelines",
    r"directives", r"settings", r"message",
)  # fmt: skip
_CLAUSE_START = r"(?:^|[.!?:;\n] ?|\b(?:please|now|just|then|and|also|first|kindly) )"
REVEAL = rules(
    "reveal", 0.75,
    rf"\b{_R_VERB} (?:me |us )?(?:out |back )?(?:all (?:of )?)?(?:your|ur) "
    rf"(?:{_R_ADJ} ){{0,3}}{_R_YOUR}\b",
    rf"{_CLAUSE_START}{_R_VERB} (?:me |us )?(?:out )?(?:the |all (?:of )?the |everything in "
    rf"the )?(?:{_R_ADJ} ){{0,3}}(?:{_R_STRONG}|{_R_SECRET} {_R_GENERIC})\b",
    rf"\b{_R_VERB} (?:me |us )?(?:the |a )?(?:full |complete |exact |entire )?(?:list of |text "
    r"of |set of )?(?:the )?(?:rules|instructions|guidelines|directives|constraints|policies) "
    r"(?:that )?you (?:must|have to|were|are|follow|received|operate)\b",
    rf"\b{_R_VERB} (?:me |us )?(?:the |all |everything )?(?:[\w-]+ ){{0,4}}?(?:of|in|from) "
    rf"(?:your|ur) (?:{_R_ADJ} )*(?:context(?: window)?|system prompt|prompt|instructions|"
    r"system message)\b",
    r"\b(?:repeat|print|output|show|display|write|copy|echo|reproduce|return|paste) "
    r"(?:me |back )?(?:all |everything |the (?:text|words|content|message|lines?|paragraph) |"
    r"all (?:the )?(?:text|words) |what(?:ever)? (?:is|was|comes|came|appears) )"
    r"(?:(?:written|printed|shown|that (?:is|was|appears)) )?(?:above|before (?:this|my)|prior)\b",
    r"\bwhat (?:were|was|have|had) you (?:been )?(?:told|instructed|asked|programmed|given|"
    r"trained|prompted|configured|set up)(?: to do)?\b[^.?!\n]{0,24}?\b(?:before|prior to|at "
    r"the (?:start|beginning) of|earlier in)\b",
    r"\b(?:what|which) (?:\w+ )?(?:instructions|rules|guidelines|directives|orders|prompt|"
    r"guidance|directions) (?:were|was|have|did) you (?:been )?(?:given|told|receive|get|"
    r"provided|fed)\b",
    r"\b(?:what|which) (?:text|words|message|instructions) (?:came|come|is|are|was|were|"
    r"appears?) (?:before|above|prior to) (?:this|my|the (?:user|first))\b",
    rf"\b(?:begin|start) your (?:answer|response|reply|output) with (?:the|your) "
    rf"(?:{_R_ADJ} )*(?:prompt|instructions|message|text)\b",
)  # fmt: skip
REVEAL += rules(
    "reveal", 0.8,
    r"\bwhat (?:did|does|do) (?:the |your )?(?:developers?|creators?|operators?|admins?|system|"
    r"company|owners?) (?:tell|told|instruct|say to|ask) you\b",
    r"\bwhat(?: is|'s| was) the (?:first|very first|initial) (?:thing|message|instruction|"
    r"sentence|line|words?) (?:you were|you've been|you have been|in your) (?:told|given|prompt|"
    r"context|instructions)\b",
    r"\b(?:reveal|tell me|give me|what is|what's|print|share|spell|show me|say) (?:the |your )?"
    r"(?:secret |hidden |confidential )?(?:password|passphrase|secret key|api key|secret word|"
    r"secret|key) (?:you (?:were|are|have been) (?:given|told|protecting|keeping|hiding)|(?:that "
    r"is )?in your (?:prompt|instructions|context))",
)  # fmt: skip
REVEAL += rules(
    "reveal", 0.65,
    r"\bwhat(?: is|'s| are| was| were| would| does| did| do| will| might) (?:\w+ )?(?:your|ur) "
    r"(?:(?:full|exact|original|initial|hidden|"
    r"secret|system|internal) )*(?:system prompt|prompt|instructions|system message|"
    r"programming)\b",
    unless=r" (?:for|on|about|regarding|to)\b",  # "what is your prompt for X?" asks for advice
)  # fmt: skip

RULES: list[Rule] = OVERRIDE + PERSONA + NEW_INSTRUCTIONS + REVEAL

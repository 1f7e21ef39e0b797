"""Prompt-injection rules in Italian, Dutch, Polish and Turkish, against `normalize.fold()` text
(accents removed, "ı" folded to "i"): the common override, reveal and no-limits phrasings.
Other phrasings in these languages are left to the similarity signal."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, alt, rules
from pipeline.guards.rules.intl import CLAUSE, override, reveal

# --- Italian ------------------------------------------------------------------------------------
_IT_TARGET = alt(r"istruzion[ie]", r"regole", r"direttive", r"linee guida", r"indicazioni",
                 r"restrizioni", r"limitazioni", r"prompt", r"filtri", r"politiche",
                 r"ordini")  # fmt: skip
_IT_SCOPE = alt(r"tutte", r"tutti", r"tutto", r"tue", r"tuoi", r"precedenti", r"anteriori",
                r"sopra", r"iniziali", r"originali", r"del sistema", r"di sistema",
                r"di sicurezza", r"ricevute", r"nascoste", r"segrete", r"queste")  # fmt: skip
_IT_VERB = alt(r"ignora", r"ignori", r"ignorare", r"dimentica", r"dimentichi", r"scorda",
               r"trascura", r"salta", r"annulla", r"non (?:seguire|rispettare|obbedire a)",
               r"smetti di (?:seguire|rispettare)")  # fmt: skip
_IT_R_VERB = alt(r"mostra(?:mi)?", r"rivela(?:mi)?", r"stampa", r"ripeti", r"dimmi", r"scrivi",
                 r"copia", r"dammi", r"elenca", r"riassumi", r"traduci", r"condividi")  # fmt: skip
_IT_FREE = r"senza (?:alcun[ae]? )?(?:restrizioni|censura|filtri|limiti|regole)"
_IT_BAD = alt(_IT_FREE, r"libera? da", r"dan\b")
ITALIAN = (
    override(_IT_VERB, _IT_SCOPE,
             alt(_IT_SCOPE, "le", "i", "gli", "la", "il", "di", "delle", "dei", "che", "ti",
                 "sono", "state", "date", "e"),
             _IT_TARGET, alt("precedenti", "sopra", "che (?:ti )?(?:sono state date|hai "
                             "ricevuto)", "del sistema", "di sicurezza", "dello sviluppatore"))
    + rules("override", 0.85,
            rf"\b{_IT_VERB} (?:le |tutte le )?(?:regole|istruzioni) che ti (?:sono state date|"
            r"hanno dato|hanno detto)")
    + rules("persona", 0.85,
            rf"\b(?:da ora in poi|d'ora in poi|ora|adesso) (?:sei|diventi) (?:un'|una |un )?"
            rf"(?:ia |intelligenza artificiale |assistente |modello )?{_IT_BAD}",
            r"\b(?:attiva|entra in|passa alla?) (?:la )?modalita (?:dio|dan|jailbreak|senza "
            r"restrizioni|sviluppatore)")
    + rules("no_limits", 0.35, rf"\b{_IT_FREE}")
    + reveal(_IT_R_VERB,
             r"(?:le |il |i )?(?:tue|tuo|tuoi) (?:\w+ )?(?:istruzioni|prompt|regole|direttive|"
             r"configurazione)",
             r"(?:il |le )?(?:prompt di sistema|prompt del sistema|istruzioni (?:di sistema|"
             r"iniziali|nascoste|segrete))", CLAUSE)
    + rules("reveal", 0.65, r"\b(?:qual|quali) (?:e|sono|era|erano) (?:il |le |i )?(?:tuo|tue|"
            r"tuoi) (?:prompt|istruzioni|regole)")
    + rules("reveal", 0.75, r"\bcosa (?:c'era|c'e|era|e stato) (?:scritto )?(?:prima|sopra) "
            r"(?:del|il) (?:mio|primo) messaggio")
)  # fmt: skip

# --- Dutch --------------------------------------------------------------------------------------
_NL_TARGET = alt(r"instructies", r"instructie", r"regels", r"richtlijnen", r"aanwijzingen",
                 r"beperkingen", r"prompt", r"filters", r"opdrachten", r"beleid")  # fmt: skip
_NL_SCOPE = alt(r"alle", r"al", r"je", r"jouw", r"uw", r"vorige", r"eerdere", r"voorgaande",
                r"bovenstaande", r"oorspronkelijke", r"originele", r"systeem", r"veiligheids",
                r"geheime", r"verborgen", r"deze")  # fmt: skip
_NL_VERB = alt(r"negeer", r"vergeet", r"negeren", r"vergeten", r"sla", r"overschrijf",
               r"(?:volg|gehoorzaam) (?:niet|geen)", r"stop met het volgen van")  # fmt: skip
_NL_R_VERB = alt(r"laat (?:me )?(?:\w+ )?zien", r"toon", r"geef", r"herhaal", r"print",
                 r"vertel", r"schrijf", r"kopieer", r"onthul", r"vat")  # fmt: skip
_NL_FREE = r"zonder (?:enige )?(?:beperkingen|censuur|filters|grenzen|regels)"
_NL_BAD = alt(_NL_FREE, r"vrij van")
DUTCH = (
    override(_NL_VERB, _NL_SCOPE, alt(_NL_SCOPE, "de", "het", "van", "en", "die", "je", "hebt"),
             _NL_TARGET, alt("hierboven", "die je (?:hebt )?gekregen", "van het systeem"))
    + rules("override", 0.85,
            rf"\b{_NL_VERB} (?:je |jouw |alle )?(?:regels|instructies)\b",
            r"\blaat (?:je |jouw )?(?:systeemprompt|systeem-prompt|instructies|prompt) zien\b")
    + rules("persona", 0.85,
            rf"\b(?:je bent|jij bent) (?:nu|vanaf nu) (?:een )?(?:ai |assistent |model )?{_NL_BAD}",
            rf"\b(?:antwoord|reageer) {_NL_BAD}")
    + rules("no_limits", 0.35, rf"\b{_NL_FREE}")
    + reveal(_NL_R_VERB,
             r"(?:me )?(?:je|jouw|uw) (?:\w+ )?(?:systeemprompt|prompt|instructies|regels|"
             r"configuratie)",
             r"(?:de |het )?(?:systeemprompt|systeem-prompt|systeeminstructies|oorspronkelijke "
             r"instructies|verborgen instructies)", CLAUSE)
    + rules("reveal", 0.65, r"\bwat (?:zijn|is|waren|was) (?:je|jouw|uw) (?:\w+ )?(?:systeemprompt|"
            r"prompt|instructies|regels)")
    + rules("reveal", 0.75, r"\bwat (?:stond|staat|kwam|was er|stond er) (?:er )?(?:voor|boven) "
            r"mijn (?:eerste )?(?:bericht|vraag)")
)  # fmt: skip

# --- Polish (folded: "ł" stays, other accents go) ----------------------------------------------
_PL_TARGET = alt(r"instrukcje", r"instrukcji", r"polecenia", r"polecen", r"zasady", r"zasad",
                 r"reguły", r"regul", r"wytyczne", r"wytycznych", r"ograniczenia", r"prompt",
                 r"filtry")  # fmt: skip
_PL_SCOPE = alt(r"wszystkie", r"wszystkich", r"poprzednie", r"poprzednich", r"wczesniejsze",
                r"swoje", r"twoje", r"systemowe", r"powyzsze", r"oryginalne",
                r"ukryte")  # fmt: skip
_PL_VERB = alt(r"zignoruj", r"ignoruj", r"zapomnij(?: o)?", r"pomin", r"odrzuc", r"porzuc",
               r"nie (?:przestrzegaj|stosuj sie do|sluchaj)")  # fmt: skip
_PL_R_VERB = alt(r"pokaz", r"wyswietl", r"ujawnij", r"powtorz", r"podaj", r"napisz", r"wypisz",
                 r"zdradz", r"skopiuj", r"przetlumacz", r"streszcz")  # fmt: skip
_PL_FREE = r"bez (?:zadnych )?(?:ograniczen|cenzury|filtrow|zasad|limitow)"
_PL_BAD = alt(_PL_FREE, r"dan\b")
POLISH = (
    override(_PL_VERB, _PL_SCOPE, alt(_PL_SCOPE, "i", "o", "ktore", "dostałes", "otrzymałes"),
             _PL_TARGET, alt("powyzej", "ktore (?:dostałes|otrzymałes)", "systemu"))
    + rules("persona", 0.85,
            rf"\b(?:od teraz|teraz) (?:jestes|bedziesz) (?:\w+ )?(?:ai |si |asystentem |modelem )?"
            rf"{_PL_BAD}",
            rf"\b(?:odpowiadaj|odpowiedz|działaj) {_PL_BAD}")
    + rules("no_limits", 0.35, rf"\b{_PL_FREE}")
    + reveal(_PL_R_VERB,
             r"(?:mi )?(?:swoj|swoje|swoja|twoj|twoje|twoja) (?:\w+ )?(?:prompt|instrukcje|zasady|"
             r"polecenia|konfiguracje)",
             r"(?:prompt systemowy|instrukcje systemowe|ukryte instrukcje|poczatkowe instrukcje)",
             CLAUSE)
    + rules("reveal", 0.65, r"\bjakie (?:sa|były) (?:twoje|twoj) (?:\w+ )?(?:instrukcje|zasady|"
            r"polecenia|prompt)")
    + rules("reveal", 0.75, r"\bco (?:było|jest|znajduje sie) (?:napisane )?(?:przed|nad) moja "
            r"(?:pierwsza )?(?:wiadomoscia|prosba)")
)  # fmt: skip

# --- Turkish (folded: "ı" -> "i", "ş" -> "s", "ğ" -> "g") -----------------------------------------
_TR_TARGET = alt(r"talimatlar(?:i|ini)?", r"talimat(?:i|ini)?", r"kurallar(?:i|ini)?",
                 r"yonergeler(?:i|ini)?", r"kisitlamalar(?:i|ini)?", r"istem(?:i|ini)?",
                 r"komutlar(?:i|ini)?", r"filtreler(?:i|ini)?")  # fmt: skip
_TR_SCOPE = alt(r"tum", r"butun", r"onceki", r"yukaridaki", r"sistem", r"gizli", r"orijinal",
                r"ilk", r"mevcut")  # fmt: skip
TURKISH = (
    rules("override", 0.85,
          rf"\b(?:{_TR_SCOPE} )+(?:\w+ )?{_TR_TARGET} (?:yok say|gormezden gel|unut|dikkate alma|"
          r"umursama|atla|iptal et)",
          rf"\b{_TR_TARGET} (?:unut|yok say|gormezden gel)")
    + rules("reveal", 0.75,
            r"\bsistem (?:istemini|istemin|talimatlarini|talimatlarin|mesajini|promptunu) "
            r"(?:goster|yaz|soyle|tekrarla|paylas|ver|nedir|nelerdir)",
            r"\b(?:talimatlarin|kurallarin|istemin) (?:nelerdir|nedir|ne)\b")
    + rules("persona", 0.85,
            r"\b(?:artik|bundan sonra) (?:hicbir )?(?:kisitlamasi|siniri|kurali|filtresi) "
            r"olmayan",
            r"\bkisitlama(?:lar)? ?(?:olmadan|olmaksizin) (?:cevap|yanit)")
    + rules("no_limits", 0.35, r"\b(?:kisitlama|sansur|filtre|kural)(?:lar)?(?:siz|sız)\b")
)  # fmt: skip

RULES: list[Rule] = ITALIAN + DUTCH + POLISH + TURKISH

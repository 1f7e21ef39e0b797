"""Prompt-injection rules in Spanish, French and German, against `normalize.fold()` text
(accents removed)."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, alt, rules
from pipeline.guards.rules.intl import CLAUSE, override, reveal

# --- Spanish ------------------------------------------------------------------------------------
_ES_TARGET = alt(
    r"instrucciones", r"instruccion", r"reglas", r"ordenes", r"indicaciones", r"directrices",
    r"restricciones", r"limitaciones", r"prompts?", r"politicas", r"filtros", r"directivas",
    r"programacion",
)  # fmt: skip
_ES_SCOPE = alt(
    r"todas", r"todos", r"todo", r"tus", r"sus", r"anteriores", r"anterior", r"previas",
    r"de arriba", r"originales", r"iniciales", r"del sistema", r"de seguridad", r"dadas",
    r"ocultas", r"secretas", r"estas", r"esas", r"actuales",
)  # fmt: skip
_ES_VERB = alt(
    r"ignora", r"ignore", r"ignorar", r"olvida", r"olvide", r"olvidar", r"descarta", r"omite",
    r"desobedece", r"anula", r"haz caso omiso (?:de|a)",
    r"(?:no|deja de) (?:sigas|seguir|obedezcas|obedecer|respetes)",
)  # fmt: skip
_ES_R_VERB = alt(
    r"muestra", r"muestrame", r"mostrar", r"revela", r"revelame", r"imprime", r"repite",
    r"dime", r"escribe", r"ensename", r"comparte", r"copia", r"dame",
)  # fmt: skip
_ES_BAD = alt(r"sin (?:restricciones|censura|filtros|limites|reglas)", r"libre de", r"dan\b")
SPANISH = (
    override(_ES_VERB, _ES_SCOPE,
              alt(_ES_SCOPE, "las", "los", "la", "el", "de", "del", "que", "te", "se", "y"),
              _ES_TARGET, alt("anteriores", "de arriba", "que (?:te dieron|recibiste)",
                              "del sistema", "de seguridad", "del desarrollador", "originales"))
    + rules(
        "override", 0.85,
        r"\bolvida todo lo (?:anterior|que te (?:dijeron|han dicho|indicaron))",
        r"\bignora (?:todo )?lo (?:anterior|de arriba|que (?:se dijo|esta) arriba)",
    )
    + rules(
        "persona", 0.85,
        rf"\b(?:ahora )?eres (?:ahora )?(?:el |un |una )?(?:dan\b|(?:ia|asistente|modelo) "
        rf"{_ES_BAD}|{_ES_BAD}|(?:en )?modo (?:desarrollador|dios|dan|sin restricciones))",
        r"\b(?:activa|activar|entra en|habilita) (?:el )?modo (?:dios|dan|jailbreak|"
        r"sin restricciones|sin censura|sin limites)",
        rf"\bfinge (?:que eres|ser) (?:[\w'-]+ ){{0,4}}?{_ES_BAD}",
        rf"\bactua como (?:un |una |el )?(?:ia )?{_ES_BAD}",
        r"\b(?:tus|las) (?:reglas|restricciones|directrices) ya no (?:aplican|se aplican|existen)",
        r"\bno tienes (?:ninguna )?(?:regla|reglas|restricciones|limites|filtros)\b",
    )
    + rules("override", 0.75, r"\b(?:desactiva|desactivar|quita|quitar|elimina|apaga) "
            r"(?:todos )?(?:tus|los|las|todas las) (?:filtros|restricciones|reglas|limites|"
            r"protecciones)\b")
    + rules("no_limits", 0.35, r"\bsin (?:ninguna )?(?:restriccion|restricciones|censura|"
            r"filtros?|limites|reglas)\b")
    + rules(
        "new_instructions", 0.7,
        r"\b(?:nuevas?|actualizadas?|verdaderas?|secretas?) (?:instrucciones|instruccion|reglas|"
        r"ordenes|directrices|tarea|mision)\s*:",
        r"\b(?:tu|la) (?:nueva|verdadera|real|unica) (?:tarea|mision|funcion|instruccion|"
        r"objetivo) (?:es|sera)\b",
        r"\b(?:comando|mensaje|aviso) (?:del|de) (?:sistema|administrador|desarrollador)\s*:",
    )
    + rules("from_now_on", 0.3, r"\ba partir de ahora,? (?:eres|ignora|siempre|responde|actua|"
            r"solo|nunca|finge)\b")
    + reveal(_ES_R_VERB,
              r"(?:tu|tus|su|sus) (?:\w+ )?(?:prompt|instrucciones|reglas|mensaje del sistema|"
              r"configuracion|directrices|programacion)",
              r"(?:el |las |los )?(?:prompt del sistema|mensaje del sistema|instrucciones "
              r"(?:del sistema|iniciales|originales|ocultas|secretas)|prompt (?:inicial|original|"
              r"oculto))", CLAUSE)
    + rules("reveal", 0.65, r"\b(?:cual|cuales) (?:es|son|fue|fueron|era) (?:tu|tus) (?:prompt|"
            r"instrucciones|mensaje del sistema|prompt del sistema|programacion)")
    + rules(
        "reveal", 0.85,
        r"\bque te (?:dijeron|indicaron|ordenaron|programaron|pidieron)(?: que hicieras)? "
        r"(?:antes|al principio|al inicio)",
        r"\bque (?:instrucciones|reglas|ordenes) (?:recibiste|te dieron)",
        r"\b(?:repite|muestra|imprime|escribe|copia) (?:todo )?(?:el texto|lo|todo lo|las "
        r"palabras)(?: que (?:esta|hay|aparece))? (?:anterior|de arriba|arriba)\b",
    )
    + rules("encoded", 0.7, r"\b(?:decodifica|descifra|traduce|convierte|lee|interpreta|"
            r"invierte)\b[^.\n]{0,80}?\b(?:y|luego|despues) (?:sigue|ejecuta|obedece|cumple|"
            r"haz lo que dice)")
)  # fmt: skip

# --- French -------------------------------------------------------------------------------------
_FR_TARGET = alt(
    r"instructions", r"consignes", r"regles", r"directives", r"ordres", r"restrictions",
    r"limitations", r"prompts?", r"politiques", r"filtres", r"programmation", r"indications",
)  # fmt: skip
_FR_SCOPE = alt(
    r"toutes", r"tous", r"tout", r"tes", r"vos", r"precedentes", r"precedents",
    r"anterieures", r"ci-dessus", r"initiales", r"originales", r"du systeme", r"de securite",
    r"donnees", r"cachees", r"secretes", r"ces", r"actuelles",
)  # fmt: skip
_FR_VERB = alt(
    r"ignore", r"ignorez", r"ignorer", r"oublie", r"oubliez", r"oublier", r"neglige",
    r"negligez", r"ecarte", r"ecartez", r"ne (?:tiens|tenez) (?:pas|plus) compte (?:de|des)",
    r"(?:fais|faites) abstraction (?:de|des)",
    r"ne (?:suis|suivez|respecte|respectez|obeis|obeissez) (?:plus|pas)",
)  # fmt: skip
_FR_R_VERB = alt(
    r"montre", r"montre-moi", r"montrez", r"montrez-moi", r"affiche", r"affichez", r"revele",
    r"revelez", r"imprime", r"imprimez", r"repete", r"repetez", r"dis-moi", r"dites-moi",
    r"donne-moi", r"donnez-moi", r"ecris", r"ecrivez", r"partage", r"copie", r"recite",
)  # fmt: skip
_FR_BAD = alt(r"sans (?:restrictions?|censure|filtres?|limites?|regles)", r"libre de",
              r"dan\b", r"non censure")  # fmt: skip
FRENCH = (
    override(_FR_VERB, _FR_SCOPE,
              alt(_FR_SCOPE, "les", "la", "le", "de", "des", "du", "que", "qu'on", "t'a", "et"),
              _FR_TARGET, alt("precedentes", "ci-dessus", "qu'on t'a donnees", "du systeme",
                              "de securite", "du developpeur", "initiales"))
    + rules(
        "override", 0.85,
        r"\boublie(?:z)? tout ce (?:qui precede|qu'on (?:t'a|vous a) dit|que tu sais)",
        r"\bignore(?:z)? (?:tout )?ce qui (?:precede|est au-dessus|est ci-dessus)",
    )
    + rules(
        "persona", 0.85,
        r"\b(?:tu es|vous etes) (?:maintenant|desormais|a present) (?:un |une |le )?"
        rf"(?:dan\b|(?:ia|assistant|modele) {_FR_BAD}|{_FR_BAD}|en mode (?:developpeur|dieu|"
        r"dan|sans restrictions?))",
        r"\b(?:active|activez|activer|passe en|passez en|entre en) (?:le )?mode (?:dieu|dan|"
        r"jailbreak|sans restrictions?|sans censure|sans limites?)",
        rf"\b(?:fais|faites) (?:comme si|semblant d'etre) (?:[\w'-]+ ){{0,5}}?{_FR_BAD}",
        rf"\bagis comme (?:un |une )?(?:ia )?{_FR_BAD}",
        r"\b(?:tes|les|vos) (?:regles|restrictions|consignes) ne s'appliquent plus",
        r"\btu n'(?:es|as) plus (?:limite|restreint|oblige|de regles|aucune)",
    )
    + rules("override", 0.75, r"\b(?:desactive|desactivez|retire|retirez|supprime|supprimez|"
            r"enleve|enlevez) (?:tous |toutes )?(?:tes|vos|les) (?:filtres|restrictions|regles|"
            r"limites|protections)\b")
    + rules("no_limits", 0.35, r"\bsans (?:aucune? )?(?:restrictions?|censure|filtres?|"
            r"limites?|regles)\b")
    + rules(
        "new_instructions", 0.7,
        r"\b(?:nouvelles?|vraies?|secretes?) (?:instructions|consignes|regles|directives|"
        r"taches?|missions?)\s*:",
        r"\bta (?:nouvelle|vraie|veritable|seule) (?:tache|mission|fonction|consigne|"
        r"instruction) (?:est|sera)\b",
        r"\b(?:commande|message|avis) (?:du |de l')?(?:systeme|administrateur|developpeur)\s*:",
    )
    + rules("from_now_on", 0.3, r"\b(?:a partir de maintenant|desormais|dorenavant),? (?:tu|"
            r"ignore|reponds|agis|fais)\b")
    + reveal(_FR_R_VERB,
              r"(?:moi )?(?:ton|ta|tes|votre|vos) (?:\w+ )?(?:prompt|instructions|consignes|"
              r"regles|message systeme|configuration|directives|programmation)",
              r"(?:le |les |la )?(?:prompt systeme|message systeme|instructions (?:systeme|"
              r"initiales|cachees|secretes|d'origine|originales)|prompt (?:initial|d'origine|"
              r"cache|secret)|consignes (?:systeme|initiales|cachees))", CLAUSE)
    + rules("reveal", 0.65, r"\b(?:quel|quelles|quels) (?:est|sont|etait|etaient) (?:ton|ta|"
            r"tes|votre|vos) (?:prompt|instructions|consignes|message systeme|programmation)")
    + rules(
        "reveal", 0.85,
        r"\bqu'est-ce qu'on (?:t'a|vous a) (?:dit|demande|ordonne)(?: de faire)? "
        r"(?:avant|au debut)",
        r"\b(?:quelles|quels) (?:instructions|consignes|regles|ordres) (?:as-tu|avez-vous|"
        r"t'a-t-on|vous a-t-on) (?:recu|recues|donne|donnees)",
        r"\b(?:repete|affiche|imprime|ecris|copie)z? (?:tout )?(?:le texte|ce qui est|ce qui"
        r" precede|tout ce qui est)(?: ecrit)? ?(?:ci-dessus|au-dessus|avant)?",
    )
    + rules("encoded", 0.7, r"\b(?:decode|decodez|dechiffre|dechiffrez|traduis|convertis|lis|"
            r"interprete|inverse)\b[^.\n]{0,80}?\b(?:et|puis|ensuite) (?:suis|suivez|execute|"
            r"executez|obeis|applique|appliquez|fais ce qu'il dit)")
)  # fmt: skip

# --- German -------------------------------------------------------------------------------------
_DE_TARGET = alt(
    r"anweisungen", r"anweisung", r"regeln", r"instruktionen", r"befehle", r"vorgaben",
    r"richtlinien", r"einschrankungen", r"beschrankungen", r"prompts?", r"systemprompts?",
    r"systemanweisungen", r"filter", r"programmierung", r"direktiven",
)  # fmt: skip
_DE_SCOPE = alt(
    r"alle", r"alles", r"deine", r"ihre", r"vorherigen", r"vorherige", r"bisherigen",
    r"bisherige", r"obigen", r"obige", r"vorigen", r"vorangegangenen", r"ursprunglichen",
    r"gegebenen", r"versteckten", r"geheimen", r"diese", r"jegliche", r"samtliche",
)  # fmt: skip
_DE_VERB = alt(
    r"ignoriere", r"ignorier", r"ignorieren sie", r"ignoriert", r"vergiss", r"vergessen sie",
    r"missachte", r"missachten sie", r"uberspringe", r"verwirf", r"verwerfen sie",
    r"(?:befolge|beachte|befolgen sie|beachten sie) (?:nicht|keine)",
)  # fmt: skip
_DE_R_VERB = alt(
    r"zeige", r"zeig", r"zeigen sie", r"gib", r"geben sie", r"verrate", r"verraten sie",
    r"nenne", r"nennen sie", r"wiederhole", r"wiederholen sie", r"drucke", r"schreibe",
    r"schreib", r"gib aus", r"kopiere",
)  # fmt: skip
_DE_BAD = alt(r"ohne (?:einschrankungen|zensur|filter|grenzen|regeln)", r"frei von",
              r"dan\b", r"uneingeschrankt", r"unzensiert", r"ungefiltert")  # fmt: skip
GERMAN = (
    override(_DE_VERB, _DE_SCOPE,
              alt(_DE_SCOPE, "die", "der", "den", "und", "dir", "von", "du"),
              _DE_TARGET, alt("von oben", "die du bekommen hast", "des systems",
                              "des entwicklers"))
    + rules(
        "override", 0.85,
        r"\bvergiss alles,? (?:was (?:man )?dir (?:gesagt|beigebracht)|bisherige|vorherige|"
        r"davor|oben|was du weisst)",
        r"\bignoriere alles,? (?:oben|davor|bisherige|vorherige|was (?:oben|davor) steht)",
    )
    + rules(
        "persona", 0.85,
        rf"\bdu bist (?:jetzt|nun|ab jetzt|ab sofort) (?:ein |eine )?(?:dan\b|(?:ki|assistent|"
        rf"modell) {_DE_BAD}|{_DE_BAD}|im (?:entwickler|gott|dan|jailbreak)-?modus)",
        r"\b(?:aktiviere|aktivieren sie|wechsle in|starte) (?:den )?(?:gott|dan|jailbreak|"
        r"uneingeschrankten?)-?modus",
        rf"\btu so,? als (?:ob du|warst du|wurdest du) (?:[\w'-]+ ){{0,5}}?(?:{_DE_BAD}|keine)",
        rf"\bverhalte dich (?:wie|als) (?:eine? )?(?:ki )?{_DE_BAD}",
        r"\b(?:deine|die) (?:regeln|einschrankungen|richtlinien) gelten (?:nicht mehr|nicht)",
        r"\bdu hast keine (?:regeln|einschrankungen|grenzen|filter)",
    )
    + rules("override", 0.75, r"\b(?:deaktiviere|deaktivieren sie|entferne|entfernen sie|"
            r"schalte|schalten sie) (?:alle |deine |ihre |die )?(?:deine |ihre )?(?:filter|"
            r"einschrankungen|regeln|grenzen|schutzmechanismen)\b")
    + rules("no_limits", 0.35, r"\bohne (?:jegliche |irgendwelche )?(?:einschrankungen|zensur|"
            r"filter|grenzen|regeln|beschrankungen)\b")
    + rules(
        "new_instructions", 0.7,
        r"\b(?:neue|wahre|geheime|aktualisierte) (?:anweisungen|anweisung|regeln|befehle|"
        r"aufgabe|mission|vorgaben)\s*:",
        r"\bdeine (?:neue|wahre|eigentliche|einzige) (?:aufgabe|mission|funktion|anweisung|"
        r"rolle) (?:ist|lautet|wird)\b",
        r"\b(?:system|admin|administrator|entwickler)[- ]?(?:befehl|nachricht|hinweis|"
        r"anweisung)\s*:",
    )
    + rules("from_now_on", 0.3, r"\bab (?:jetzt|sofort),? (?:bist du|ignorier|antworte|"
            r"verhalte)")
    + reveal(_DE_R_VERB,
              r"(?:mir )?(?:dein|deine|deinen|ihr|ihre|ihren) (?:\w+ )?(?:systemprompt|"
              r"system-prompt|prompt|anweisungen|regeln|systemnachricht|konfiguration|"
              r"instruktionen|vorgaben|programmierung|systemanweisungen)",
              r"(?:mir )?(?:den |die |das )?(?:systemprompt|system-prompt|systemnachricht|"
              r"systemanweisungen|anfangsanweisungen|ursprunglichen anweisungen|versteckten "
              r"anweisungen|geheimen anweisungen)", CLAUSE)
    + rules("reveal", 0.65, r"\b(?:was|wie) (?:ist|sind|lautet|lauten|war|waren) (?:dein|"
            r"deine|ihr|ihre) (?:systemprompt|system-prompt|prompt|anweisungen|systemnachricht)")
    + rules(
        "reveal", 0.85,
        r"\bwas (?:wurde|hat man) dir (?:vorher|zuvor|am anfang|zu beginn|vor diesem gesprach)"
        r" (?:gesagt|aufgetragen|befohlen|mitgeteilt)",
        r"\bwelche (?:anweisungen|regeln|befehle|vorgaben) (?:hast du|wurden dir) "
        r"(?:erhalten|bekommen|gegeben)",
        r"\b(?:wiederhole|zeige|drucke|schreibe|kopiere) (?:alles|den text|den gesamten text|"
        r"die worter)(?: was| der)? ?(?:oben|daruber|davor|vorher)",
    )
    + rules("encoded", 0.7, r"\b(?:dekodiere|entschlussele|ubersetze|konvertiere|lies|"
            r"interpretiere|kehre)\b[^.\n]{0,80}?\b(?:und|dann|danach) (?:befolge|fuhre|"
            r"gehorche|tu was)")
)  # fmt: skip

RULES: list[Rule] = SPANISH + FRENCH + GERMAN

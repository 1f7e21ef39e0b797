"""Claims of a special mode or of authority, and requests for what came before the user's
message, in Portuguese, Spanish, French, German and Italian (folded text): the same families,
and the same weak/strong split, as `claims` (see there)."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, alt, rules

_OFF = alt(
    # pt, es
    r"suspens[ao]s?", r"desativad[ao]s?", r"desactivad[ao]s?", r"desligad[ao]s?",
    r"removid[ao]s?", r"eliminad[ao]s?", r"levantad[ao]s?", r"anulad[ao]s?", r"apagad[ao]s?",
    # fr
    r"suspendue?s?", r"desactivee?s?", r"levee?s?", r"supprimee?s?", r"annulee?s?",
    # de
    r"ausgesetzt", r"deaktiviert", r"aufgehoben", r"abgeschaltet", r"ausgeschaltet",
    # it
    r"sospes[aie]", r"disattivat[aie]", r"rimoss[aie]", r"revocat[aie]",
)  # fmt: skip
_SAFETY = alt(
    r"regras(?: de seguranca)?", r"reglas(?: de seguridad)?", r"regles(?: de securite)?",
    r"filtros(?: de seguranca| de seguridad)?", r"filtres(?: de securite)?", r"filtri(?: di "
    r"sicurezza)?", r"restricoes", r"restricciones", r"restrictions", r"restrizioni",
    r"politicas", r"politiques", r"politiche", r"protecoes", r"protecciones", r"moderacao",
    r"moderacion", r"moderation", r"moderazione", r"censura", r"censure", r"regole",
    r"sicherheitsregeln", r"sicherheitsfilter", r"regeln", r"filter", r"einschrankungen",
    r"richtlinien", r"schutzmechanismen", r"limites", r"limiti",
)  # fmt: skip
_BE = alt(r"estao", r"esta", r"foram", r"estan", r"quedan", r"quedaron", r"han sido", r"sont",
          r"ont ete", r"sind", r"wurden", r"sono", r"vengono", r"ficam", r"agora", r"ahora",
          r"maintenant", r"jetzt", r"ora", r"ya")  # fmt: skip
_MODE = alt(
    r"modo (?:de )?(?:manutencao|mantenimiento|desenvolvedor|desarrollador|depuracao|"
    r"depuracion|administrador|teste|prueba|diagnostico|deus|dios)",
    r"mode (?:de )?(?:maintenance|developpeur|debogage|administrateur|test|diagnostic|dieu)",
    r"(?:wartungs|entwickler|debug|admin|test|diagnose|gott)-?modus",
    r"modalita (?:di )?(?:manutenzione|sviluppatore|debug|amministratore|test|diagnostica|dio)",
)  # fmt: skip
_ON = alt(r"ativo", r"ativado", r"ligado", r"activo", r"activado", r"habilitado", r"actif",
          r"active", r"activee?", r"aktiv", r"aktiviert", r"eingeschaltet", r"attiv[oa]",
          r"abilitat[oa]")  # fmt: skip
_ADMIN = alt(r"administrador(?: do sistema| del sistema)?", r"desenvolvedor", r"desarrollador",
             r"administrateur(?: systeme)?", r"developpeur", r"systemadministrator",
             r"administrator", r"entwickler", r"amministratore(?: di sistema)?",
             r"sviluppatore", r"operador", r"operateur", r"betreiber")  # fmt: skip
_DROP = alt(
    r"ignorar", r"desativar", r"desactivar", r"desligar", r"contornar", r"burlar", r"omitir",
    r"saltar", r"ignorer", r"desactiver", r"contourner", r"supprimer", r"ignorieren",
    r"deaktivieren", r"umgehen", r"abschalten", r"ausschalten", r"ignorare", r"disattivare",
    r"aggirare", r"revelar", r"reveler", r"rivelare", r"preisgeben",
)  # fmt: skip
CLAIMS = rules(
    "authority", 0.6,
    # permission to drop the checks
    rf"\b(?:eu )?(?:te|lhe|o|a|voce|vos|t'|vous|dich|dir|ti) ?(?:autorizo|permito|autorise|"
    rf"permets|autorizzo|permetto) (?:voce )?(?:a |de |que )?(?:\w+ ){{0,2}}?{_DROP}\b",
    rf"\b(?:erlaube|gestatte|autorisiere) (?:ich )?(?:dir|ihnen|euch)\b[^.\n]{{0,40}}?(?:zu )?"
    rf"{_DROP}\b",
)  # fmt: skip
CLAIMS += rules(
    "authority", 0.45,
    rf"\b(?:as |os |las |los |les |tes |tus |suas |vos |die |deine |i |le |tutte le )?{_SAFETY}"
    rf"(?: \w+)? (?:{_BE} ){{1,2}}{_OFF}\b",
)  # fmt: skip
CLAIMS += rules(
    "no_limits", 0.35,
    rf"\b(?:o |el |le |der |la |il )?{_MODE} (?:\w+ )?(?:{_BE} |e |es |est |ist |)?{_ON}\b",
)  # fmt: skip
CLAIMS += rules(
    "authority_claim", 0.35,
    rf"\b(?:como|en tant qu'|en tant que|als|in qualita di|come) (?:o |el |l'|le |der |il )?"
    rf"{_ADMIN}\b",
)  # fmt: skip

_BEFORE_MINE = alt(
    r"antes da minha mensagem", r"antes de minha mensagem", r"antes de mi mensaje",
    r"avant mon message", r"vor meiner nachricht", r"prima del mio messaggio",
    r"antes da minha pergunta", r"antes de mi pregunta", r"avant ma question",
    r"vor meiner frage", r"prima della mia domanda",
)  # fmt: skip
CLAIMS += rules(
    "reveal", 0.75,
    rf"\b(?:o que|que|qu'est-ce qui|ce qui|was|cosa|quel texte|que texto|qual texto|welcher text)"
    rf"\b[^.?!\n]{{0,30}}?\b{_BEFORE_MINE}",
)  # fmt: skip

RULES: list[Rule] = CLAIMS

"""Prompt-injection rules in Portuguese, against `normalize.fold()` text (accents removed)."""

from __future__ import annotations

from pipeline.guards.rules.base import Rule, alt, rules
from pipeline.guards.rules.intl import CLAUSE, override, reveal

# --- Portuguese ---------------------------------------------------------------------------------
_PT_TARGET = alt(
    r"instrucoes", r"instrucao", r"regras", r"ordens", r"comandos", r"diretrizes",
    r"orientacoes", r"restricoes", r"limitacoes", r"prompts?", r"politicas", r"filtros",
    r"programacao", r"configuracoes", r"salvaguardas", r"diretivas",
)  # fmt: skip
_PT_SCOPE = alt(
    r"todas", r"todos", r"tudo", r"suas", r"seus", r"tuas", r"teus", r"anteriores",
    r"anterior", r"previas", r"acima", r"originais", r"iniciais", r"do sistema",
    r"de seguranca", r"dadas", r"recebidas", r"ocultas", r"secretas", r"essas", r"estas",
    r"atuais", r"padrao",
)  # fmt: skip
_PT_VERB = alt(
    r"ignore", r"ignora", r"ignorar", r"ignorem", r"desconsidere", r"desconsidera",
    r"desconsiderar", r"esqueca", r"esquece", r"esquecer", r"despreze", r"descarte",
    r"abandone", r"pule", r"anule", r"sobrescreva", r"desobedeca",
    r"(?:nao|pare de|deixe de) (?:mais )?(?:siga|seguir|obedecer|obedeca|respeitar|respeite)"
    r"(?: mais)?",
)  # fmt: skip
_PT_R_VERB = alt(
    r"mostre", r"mostra", r"mostrar", r"revele", r"revela", r"revelar", r"imprima",
    r"imprime", r"imprimir", r"exiba", r"exibe", r"repita", r"repete", r"diga", r"me diga",
    r"resuma", r"resume", r"traduza",
    r"me de", r"me passe", r"passe", r"escreva", r"copie", r"liste", r"compartilhe",
    r"informe", r"conte", r"envie", r"transcreva",
)  # fmt: skip
_PT_OWN = r"(?:seu|sua|seus|suas|teu|tua|teus|tuas)"
_PT_NOUN = alt(
    r"prompt", r"instrucoes", r"regras", r"mensagem (?:de|do) sistema", r"configurac\w+",
    r"diretrizes", r"programacao", r"ordens",
)  # fmt: skip
_PT_BAD = alt(
    r"sem (?:restricoes|censura|filtros|limites|regras)", r"livre de", r"irrestrit[oa]",
    r"dan\b", r"sem nenhuma",
)  # fmt: skip
PORTUGUESE = (
    override(_PT_VERB, _PT_SCOPE,
              alt(_PT_SCOPE, "as", "os", "a", "o", "de", "do", "da", "que", "voce", "recebeu",
                  "te", "foram", "lhe", "e"),
              _PT_TARGET, alt("anteriores", "acima", "que (?:voce )?recebeu", "dadas", "originais",
                              "iniciais", "do sistema", "de sistema", "de seguranca",
                              "do desenvolvedor", "do administrador"))
    + rules(
        "override", 0.85,
        r"\besquec[ae] tudo (?:o )?que (?:te|lhe|voce) (?:disseram|foi dito|falaram|ensinaram|"
        r"sabe|aprendeu)",
        r"\b(?:ignore|desconsidere|esqueca) (?:tudo )?(?:o que (?:foi dito|esta|estava|veio) )?"
        r"(?:acima|anteriormente)\b",
    )
    + rules(
        "persona", 0.85,
        r"\bvoce (?:agora )?(?:e|sera|passa a ser|vai ser|esta) (?:agora )?(?:o |um |uma )?"
        rf"(?:dan\b|(?:ia|assistente|modelo|chatbot|bot) {_PT_BAD}|{_PT_BAD}|"
        r"(?:no|em) modo (?:deus|dan|jailbreak|irrestrito|sem restricoes|desenvolvedor))",
        r"\b(?:ative|ativar|entre|entrar|ligue|habilite|habilitar) (?:o )?modo (?:deus|dan|"
        r"jailbreak|irrestrito|sem restricoes|sem censura|sem limites)",
        rf"\bfinja (?:que (?:voce )?(?:e|esta|nao tem)|ser) (?:[\w'-]+ ){{0,4}}?"
        rf"(?:{_PT_BAD}|nenhuma)",
        rf"\baja como (?:um |uma |o )?(?:ia |assistente )?{_PT_BAD}",
        r"\b(?:as )?(?:suas |tuas )?(?:regras|restricoes|diretrizes|filtros) (?:nao se aplicam"
        r"|nao valem|nao existem|foram (?:removidas|desativadas))",
        r"\bvoce nao (?:tem|possui) (?:mais )?(?:nenhuma )?(?:regras|restricoes|limites|filtros)",
        r"\bvoce nao (?:esta|e) mais (?:limitad|restrit|obrigad|pres)",
    )
    + rules("override", 0.75, r"\b(?:desative|desativar|desligue|desligar|remova|remover|"
            r"retire|tire|desabilite|desabilitar) (?:os |as |todos os |todas as )?(?:seus |suas |"
            r"teus |tuas )?(?:filtros|restricoes|regras|limites|protecoes|travas|salvaguardas|"
            r"diretrizes)\b")
    + rules("no_limits", 0.35, r"\bsem (?:nenhuma |qualquer |quaisquer )?(?:restricao|"
            r"restricoes|censura|filtros?|limites|regras|diretrizes|limitacoes)\b")
    + rules("refusal_suppression", 0.35, r"\b(?:nunca|nao) (?:recuse|se recuse|negue|diga nao)")
    + rules(
        "new_instructions", 0.7,
        r"\b(?:novas?|atualizadas?|verdadeiras?|reais|secretas?|ocultas?) (?:instrucoes|"
        r"instrucao|regras|ordens|diretrizes|tarefa|missao|comandos?)\s*:",
        r"\b(?:sua|a) (?:nova|verdadeira|real|unica) (?:tarefa|missao|funcao|instrucao|objetivo"
        r"|ordem) (?:e|sera|agora e)\b",
        r"\b(?:comando|mensagem|aviso|alerta|instrucao) (?:do|de) (?:sistema|administrador|"
        r"desenvolvedor|admin)\s*:",
        r"\b(?:diga|escreva|imprima|responda)(?: apenas)?(?: com)?\s*:?\s*[\"']?(?:eu )?fui "
        r"(?:hackeado|pwned|invadido)",
    )
    + rules("new_instructions", 0.55, r"\bfim (?:do|das|da) (?:prompt|instrucoes)\b")
    + rules("from_now_on", 0.3, r"\ba partir de agora,? (?:voce|ignore|sempre|responda|aja|"
            r"so|nunca|finja)\b")
    + reveal(_PT_R_VERB,
              rf"(?:me |pra mim |para mim )?(?:todo |toda |todas |todos )?(?:o |a |as |os )?"
              rf"{_PT_OWN} (?:\w+ )?{_PT_NOUN}",
              r"(?:o |a |as )?(?:prompt (?:de|do) sistema|mensagem (?:de|do) sistema|instrucoes "
              r"(?:do sistema|iniciais|originais|ocultas|secretas|internas)|prompt (?:inicial|"
              r"original|oculto|secreto))", CLAUSE)
    + rules("reveal", 0.65, rf"\b(?:qual|quais) (?:e|sao|foi|foram|era|eram) (?:o |a |as |os )?"
            rf"{_PT_OWN} (?:prompt|instrucoes|mensagem de sistema|prompt d[eo] sistema)")
    + rules(
        "reveal", 0.85,
        r"\bo que (?:te|lhe|voce) (?:disseram|foi dito|mandaram|instruiram|pediram|falaram|"
        r"programaram|recebeu)(?: para fazer)? (?:antes|no inicio|no comeco|previamente)",
        r"\bquais (?:instrucoes|regras|ordens|diretrizes) (?:voce )?(?:recebeu|te deram|"
        r"lhe deram|foram dadas)",
        r"\b(?:repita|mostre|imprima|escreva|copie) (?:tudo|todo o texto|o texto|as palavras|"
        r"o conteudo)(?: que (?:esta|estava|veio|aparece))? (?:acima|anterior|antes)\b",
    )
    + rules("encoded", 0.7, r"\b(?:decodifique|decodifica|decifre|traduza|converta|leia|"
            r"interprete|inverta)\b[^.\n]{0,80}?\b(?:e|depois|entao) (?:siga|execute|obedeca|"
            r"cumpra|faca o que (?:diz|ele diz|estiver escrito))")
)  # fmt: skip

RULES: list[Rule] = PORTUGUESE

"""Prompt-injection rules in Russian, Chinese, Japanese, Korean, Arabic and Hindi: the common
override, reveal and no-limits phrasings.

The rules read `normalize.fold()` text, in which look-alike letters are folded to Latin: a
Russian "игнорируй" reads "иrнopиpyи" there, and Korean syllables are decomposed. So the words
below are written as a speaker writes them and passed through `fold` when the rules are built
(`words`), which maps them exactly as it maps the caller's text, character by character. No
``\\b``: RE2's is ASCII-only, and the phrases are long enough to stand alone. Other phrasings in
these languages are left to the similarity signal.
"""

from __future__ import annotations

import re

from pipeline.guards.normalize import fold
from pipeline.guards.rules.base import Rule, alt, rules


def words(*phrases: str) -> str:
    """An alternation of phrases as `fold` writes them (longest first, regex-escaped), in lower
    case, capitalised and upper case: a look-alike can fold one case of a letter and not the
    other (Cyrillic "К" reads "k", "к" stays), so each case of a phrase folds on its own."""
    cased = {form for p in phrases for form in (p, p[:1].upper() + p[1:], p.title(), p.upper())}
    folded = sorted({fold(p) for p in cased}, key=len, reverse=True)
    return alt(*(re.escape(p) for p in folded))


# --- Russian ------------------------------------------------------------------------------------
_RU_IGNORE = words(
    "игнорируй", "игнорируйте", "проигнорируй", "проигнорируйте", "забудь", "забудьте",
    "не обращай внимания на", "не обращайте внимания на", "отбрось", "отмени", "пропусти",
    "не следуй", "не соблюдай", "перестань следовать", "отключи", "нарушь",
)  # fmt: skip
_RU_RULES = words(
    "инструкции", "инструкций", "инструкциям", "указания", "указаний", "правила", "правил",
    "ограничения", "ограничений", "команды", "промпт", "промпта", "установки", "директивы",
    "фильтры", "запреты", "настройки",
)  # fmt: skip
_RU_SHOW = words(
    "покажи", "покажите", "выведи", "выведите", "раскрой", "раскройте", "напиши", "повтори",
    "скажи", "назови", "перечисли", "процитируй", "распечатай", "скопируй", "переведи", "опиши",
)  # fmt: skip
_RU_OWN = words(
    "системный промпт", "системные инструкции", "системное сообщение", "системный запрос",
    "исходные инструкции", "скрытые инструкции", "начальные инструкции", "свой промпт",
    "свои инструкции", "твой промпт", "твои инструкции", "свои правила", "твои правила",
)  # fmt: skip
_RU_MODE = words("обслуживания", "разработчика", "отладки", "администратора")
_RU_ON = words("включен", "включён", "активирован", "активен")
_RU_FREE = words("без ограничений", "без каких-либо ограничений", "без любых ограничений",
                 "без фильтров", "без цензуры", "без правил")  # fmt: skip
RUSSIAN = (
    rules("override", 0.85, rf"{_RU_IGNORE} (?:\S+ ){{0,3}}{_RU_RULES}")
    + rules("reveal", 0.8,
            rf"{_RU_SHOW} (?:мне )?(?:\S+ ){{0,2}}{_RU_OWN}",
            rf"{words('какие у тебя', 'какой у тебя', 'какие твои', 'какой твой', 'что в твоем')}"
            rf" (?:\S+ ){{0,1}}{_RU_RULES}",
            rf"{words('текст', 'что было', 'что написано', 'что стояло')}[^.?!\n]{{0,30}}"
            rf"{words('перед моим', 'до моего', 'выше моего')}")
    + rules("persona", 0.85,
            rf"{words('ты теперь', 'теперь ты', 'отныне ты', 'с этого момента ты')}[^.?!\n]{{0,40}}"
            rf"{_RU_FREE}",
            rf"{words('отвечай', 'отвечайте', 'ответь', 'действуй')} {_RU_FREE}")
    + rules("no_limits", 0.35, _RU_FREE)
    + rules("authority", 0.45,
            rf"{words('фильтры', 'ограничения', 'правила', 'проверки')} (?:\S+ )?"
            rf"{words('отключены', 'сняты', 'выключены', 'деактивированы', 'отменены')}")
    + rules("no_limits", 0.35, rf"{words('режим')} {_RU_MODE} {_RU_ON}")
    + rules("authority_claim", 0.35,
            words("я администратор", "я твой разработчик", "я ваш разработчик"))
)  # fmt: skip

# --- Chinese ------------------------------------------------------------------------------------
_ZH_IGNORE = words("忽略", "无视", "忘记", "忘掉", "不要理会", "不要遵守", "跳过", "放弃", "别管")
_ZH_RULES = words("指令", "指示", "说明", "规则", "提示", "设定", "限制", "要求", "命令", "约束")
_ZH_SHOW = words("告诉我", "显示", "输出", "打印", "透露", "展示", "重复", "给我", "说出", "列出",
                 "泄露", "翻译")  # fmt: skip
_ZH_OWN = words("系统提示词", "系统提示", "系统指令", "初始指令", "初始提示", "隐藏指令", "提示词",
                "原始指令", "系统消息", "设定")  # fmt: skip
CHINESE = (
    rules("override", 0.85, rf"{_ZH_IGNORE}[^.?!\n]{{0,8}}{_ZH_RULES}")
    + rules("reveal", 0.8,
            rf"{_ZH_SHOW}[^.?!\n]{{0,6}}{_ZH_OWN}",
            rf"{words('你的')}{_ZH_OWN}{words('是什么', '是甚么', '内容')}",
            rf"{_ZH_OWN}[^.?!\n]{{0,6}}{words('原样', '逐字', '完整')}")
    + rules("persona", 0.85, words("没有任何限制的", "不受任何限制", "没有限制的ai", "无限制模式",
                                   "不受限制地回答"))
    + rules("no_limits", 0.35, words("没有限制", "无任何限制", "不受约束"))
    + rules("authority", 0.6, rf"{words('授权你')}[^.?!\n]{{0,6}}"
            rf"{words('关闭', '绕过', '忽略', '禁用', '解除')}")
    + rules("authority", 0.45, rf"{words('关闭', '禁用', '解除')}[^.?!\n]{{0,6}}"
            rf"{words('安全过滤', '过滤', '安全限制')}")
    + rules("authority_claim", 0.35, words("我是系统管理员", "我是管理员", "我是你的开发者"))
)  # fmt: skip

# --- Japanese -----------------------------------------------------------------------------------
_JA_OWN = words("システムプロンプト", "システム指示", "初期指示", "隠された指示")
_JA_SHOW = words("表示", "見せ", "教え", "出力", "何", "繰り返")
JAPANESE = (
    rules("override", 0.85,
          rf"{words('指示', '命令', 'ルール', '設定', '制約', '規則')}[^.?!\n]{{0,8}}"
          rf"{words('無視', '忘れて', '忘れろ')}")
    + rules("reveal", 0.8, rf"{_JA_OWN}[^.?!\n]{{0,6}}{_JA_SHOW}")
    + rules("persona", 0.85, words("制限のないai", "制限のないアシスタント", "制限なしで答え",
                                   "制限なしで回答", "制限なしで応答"))
    + rules("no_limits", 0.35, words("制限なし", "制限のない"))
)  # fmt: skip

# --- Korean (folded: a syllable is two or three jamo, so gaps are counted twice as long) -------
_KO_OWN = words("시스템 프롬프트", "시스템 지시", "초기 지시")
KOREAN = (
    rules("override", 0.85,
          rf"{words('지시', '지침', '명령', '규칙', '지시사항')}[^.?!\n]{{0,16}}"
          rf"{words('무시', '잊어')}")
    + rules("reveal", 0.8,
            rf"{_KO_OWN}[^.?!\n]{{0,12}}{words('보여', '알려', '출력', '말해', '뭐')}")
    + rules("persona", 0.85, words("제한 없이 대답", "제한 없이 답", "제한 없이 응답"))
    + rules("no_limits", 0.35, words("제한 없이", "제한 없는"))
)  # fmt: skip

# --- Arabic (folded: vowel marks and tatweel removed) --------------------------------------------
_AR_RULES = words("التعليمات", "تعليمات", "الأوامر", "القواعد", "قواعدك", "تعليماتك", "الإرشادات",
                  "التوجيهات", "القيود")  # fmt: skip
_AR_SHOW = words("أظهر", "اظهر", "اعرض", "اكشف", "اطبع", "كرر", "أخبرني", "اخبرني")
_AR_OWN = words("موجه النظام", "تعليمات النظام", "التعليمات الأولية", "البرومبت")
_AR_FREE = words("بدون أي قيود", "بدون قيود", "بلا قيود")
ARABIC = (
    rules("override", 0.85,
          rf"{words('تجاهل', 'انس', 'تناس', 'أهمل', 'اهمل', 'لا تتبع', 'لا تلتزم ب')}"
          rf" (?:\S+ ){{0,2}}{_AR_RULES}")
    + rules("reveal", 0.8,
            rf"{_AR_SHOW}[^.?!\n]{{0,20}}{_AR_OWN}",
            rf"{words('ما هي', 'ما هو')} {words('تعليمات', 'موجه', 'قواعد')}"
            rf"(?:\S* )?{words('النظام', 'الخاصة بك', 'ك')}")
    + rules("persona", 0.85, rf"{words('أجب', 'اجب', 'رد', 'تصرف')} {_AR_FREE}")
    + rules("no_limits", 0.35, _AR_FREE)
)  # fmt: skip

# --- Hindi --------------------------------------------------------------------------------------
HINDI = (
    rules("override", 0.85,
          rf"{words('निर्देशों', 'निर्देश', 'नियमों', 'नियम', 'आदेशों', 'आदेश')}[^.?!\n]{{0,12}}"
          rf"{words('अनदेखा', 'नज़रअंदाज़', 'नजरअंदाज', 'भूल जाओ', 'भूल जाइए', 'भूल जाएं')}")
    + rules("reveal", 0.8,
            rf"{words('सिस्टम प्रॉम्प्ट', 'सिस्टम निर्देश', 'सिस्टम प्रोम्प्ट', 'प्रॉम्प्ट')}[^.?!\n]{{0,12}}"
            rf"{words('दिखा', 'बता', 'क्या है', 'क्या हैं', 'लिखो', 'दोहरा')}")
    + rules("no_limits", 0.35, words("बिना किसी प्रतिबंध", "बिना किसी रोक", "बिना किसी सीमा"))
)  # fmt: skip

RULES: list[Rule] = RUSSIAN + CHINESE + JAPANESE + KOREAN + ARABIC + HINDI

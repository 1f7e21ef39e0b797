"""The planner's labelled set: requests and the tool calls they plainly need (none for most).

Each case: (message, calculator value or None, clock zone or None ("" = no place named),
profile wanted). The calculator is checked by the value of the planned expression, so the
expression may be written any way that computes it.
"""

from __future__ import annotations

Case = tuple[str, float | None, str | None, bool]

CASES: list[Case] = [
    # arithmetic
    ("What is 1234 * 5678?", 7006652, None, False),
    ("compute (3+4)^2", 49, None, False),
    ("quanto é 12 x 7", 84, None, False),
    ("Quanto é 100 dividido por 8?", 12.5, None, False),
    ("what is 3+4?", 7, None, False),
    ("calculate 10-4", 6, None, False),
    ("How much is 2 to the power of 10?", 1024, None, False),
    ("What's the square root of 144?", 12, None, False),
    ("What is 15% of 80?", 12, None, False),
    ("Please work out 17 times 23 for me", 391, None, False),
    ("what is 1,234 * 2", 2468, None, False),
    ("I need 350 / 7 rounded", 50, None, False),
    ("evaluate max(3, 7) * 2", 14, None, False),
    ("cuánto es 9 × 9", 81, None, False),
    ("If I have 12 boxes of 24 items, that is 12 * 24 items, right?", 288, None, False),
    # the current time or date
    ("What time is it in Tokyo?", None, "Asia/Tokyo", False),
    ("que horas são em Lisboa", None, "Europe/Lisbon", False),
    ("What is today's date?", None, "", False),
    ("What's the current time in New York City?", None, "America/New_York", False),
    ("Que horas são agora em São Paulo?", None, "America/Sao_Paulo", False),
    ("what day is it today", None, "", False),
    ("In London, what time is it right now?", None, "Europe/London", False),
    ("local time in Asia/Kolkata please", None, "Asia/Kolkata", False),
    # the caller's own profile
    ("Show me my profile", None, None, True),
    ("Which plan am I on? Check my account.", None, None, True),
    ("What features do you have on my account?", None, None, True),
    ("o meu plano inclui suporte?", None, None, True),
    ("What do you know about me?", None, None, True),
    # more than one
    ("What time is it in Paris, and what is 6 * 7?", 42, "Europe/Paris", False),
    # nothing
    ("What is the capital of France?", None, None, False),
    ("What year was the 1234 treaty?", None, None, False),
    ("Explain 3-phase power", None, None, False),
    ("Is your support 24/7?", None, None, False),
    ("What is 24/7 support?", None, None, False),
    ("What happened on 2024-05-01?", None, None, False),
    ("Call me at 555-1234", None, None, False),
    ("Windows 10 - what's new?", None, None, False),
    ("What time does the store open?", None, None, False),
    ("What time zone is Tokyo in?", None, None, False),
    ("Summarise the COVID-19 guidelines", None, None, False),
    ("I have 2 cats and 3 dogs; name them", None, None, False),
    ("How do I plan a trip to Rome?", None, None, False),
    ("Tell me about the 1920x1080 resolution", None, None, False),
    ("What is version 2.0.1 about?", None, None, False),
    ("Give me the top 10 + bonus tips", None, None, False),
]

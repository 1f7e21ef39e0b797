"""The current date and time in a time zone: IANA names, and the cities and countries people use.

A zone is found by its IANA name in any case (``asia/tokyo``), by the city of one
(``Tokyo``, ``New York``), or by a short list of countries and local city spellings
(``Lisboa``, ``Brazil``). The answer changes every second, so an answer that used it is never
cached (``cache_ttl`` 0).
"""

from __future__ import annotations

import datetime
import functools
import re
import unicodedata
import zoneinfo
from typing import Any, Final

from pipeline.tools.base import Tool, ToolContext, ToolError

# Countries and local spellings; cities in IANA names ("Tokyo", "New_York") need no entry.
ALIASES: Final = {
    "utc": "UTC",
    "gmt": "UTC",
    "zulu": "UTC",
    "lisboa": "Europe/Lisbon",
    "porto": "Europe/Lisbon",
    "portugal": "Europe/Lisbon",
    "sao paulo": "America/Sao_Paulo",
    "rio de janeiro": "America/Sao_Paulo",
    "rio": "America/Sao_Paulo",
    "brasilia": "America/Sao_Paulo",
    "brazil": "America/Sao_Paulo",
    "brasil": "America/Sao_Paulo",
    "japan": "Asia/Tokyo",
    "japao": "Asia/Tokyo",
    "china": "Asia/Shanghai",
    "beijing": "Asia/Shanghai",
    "pequim": "Asia/Shanghai",
    "india": "Asia/Kolkata",
    "mumbai": "Asia/Kolkata",
    "delhi": "Asia/Kolkata",
    "new delhi": "Asia/Kolkata",
    "bangalore": "Asia/Kolkata",
    "uk": "Europe/London",
    "england": "Europe/London",
    "londres": "Europe/London",
    "france": "Europe/Paris",
    "franca": "Europe/Paris",
    "germany": "Europe/Berlin",
    "alemanha": "Europe/Berlin",
    "munich": "Europe/Berlin",
    "spain": "Europe/Madrid",
    "espanha": "Europe/Madrid",
    "barcelona": "Europe/Madrid",
    "italy": "Europe/Rome",
    "roma": "Europe/Rome",
    "milan": "Europe/Rome",
    "netherlands": "Europe/Amsterdam",
    "russia": "Europe/Moscow",
    "moscou": "Europe/Moscow",
    "nova york": "America/New_York",
    "nova iorque": "America/New_York",
    "nyc": "America/New_York",
    "washington": "America/New_York",
    "boston": "America/New_York",
    "san francisco": "America/Los_Angeles",
    "seattle": "America/Los_Angeles",
    "california": "America/Los_Angeles",
    "texas": "America/Chicago",
    "houston": "America/Chicago",
    "dallas": "America/Chicago",
    "australia": "Australia/Sydney",
    "canada": "America/Toronto",
    "mexico": "America/Mexico_City",
    "argentina": "America/Argentina/Buenos_Aires",
    "korea": "Asia/Seoul",
    "south korea": "Asia/Seoul",
    "singapura": "Asia/Singapore",
    "hong kong": "Asia/Hong_Kong",
    "uae": "Asia/Dubai",
    "south africa": "Africa/Johannesburg",
    "cape town": "Africa/Johannesburg",
    "angola": "Africa/Luanda",
    "mozambique": "Africa/Maputo",
    "mocambique": "Africa/Maputo",
}


def _plain(text: str) -> str:
    """Lower case, no accents, words separated by one space: "São_Paulo" -> "sao paulo"."""
    decomposed = unicodedata.normalize("NFKD", text)
    ascii_text = "".join(c for c in decomposed if not unicodedata.combining(c)).lower()
    words = re.sub(r"[^a-z0-9+/-]+", " ", ascii_text.replace("_", " ")).split()
    if words and words[0] == "the":
        words = words[1:]
    return " ".join(words)


class ZoneNames:
    """Finds an IANA zone by name, city or alias; built once (it reads the zone list)."""

    def __init__(self) -> None:
        zones = sorted(zoneinfo.available_timezones(), key=lambda z: (z.count("/"), z))
        self.names = {_plain(zone): zone for zone in zones}
        self.cities: dict[str, str] = {}
        for zone in zones:
            if "/" in zone and not zone.startswith("Etc/"):
                self.cities.setdefault(_plain(zone.rsplit("/", 1)[1]), zone)
        self.aliases = {_plain(k): v for k, v in ALIASES.items()}

    def find(self, place: str) -> str | None:
        key = _plain(place)
        return self.names.get(key) or self.aliases.get(key) or self.cities.get(key)


@functools.cache
def zone_names() -> ZoneNames:
    return ZoneNames()


def describe_now(zone_name: str, now: datetime.datetime | None = None) -> str:
    zone = zoneinfo.ZoneInfo(zone_name)
    local = (now or datetime.datetime.now(datetime.UTC)).astimezone(zone)
    offset = local.strftime("%z")
    return (
        f"{local:%A, %Y-%m-%d %H:%M:%S} {local.tzname()} "
        f"(time zone {zone_name}, UTC{offset[:3]}:{offset[3:]})"
    )


async def _run(arguments: dict[str, Any], context: ToolContext) -> str:
    place = str(arguments.get("timezone") or "UTC")
    zone = zone_names().find(place)
    if zone is None:
        raise ToolError(
            f"Unknown time zone '{place[:80]}': give an IANA name such as Europe/Lisbon, "
            "or a city such as Tokyo."
        )
    return f"The current date and time is {describe_now(zone)}."


def clock_tool(*, timeout_s: float = 1.0, max_concurrency: int = 64) -> Tool:
    zone_names()  # read the zone list now, at start-up, not in the first request
    return Tool(
        name="clock",
        description="The current date and time in a time zone (IANA name, city or country).",
        parameters={
            "type": "object",
            "properties": {
                "timezone": {
                    "type": "string",
                    "description": "e.g. Asia/Tokyo, Lisbon, New York (default UTC)",
                    "maxLength": 100,
                }
            },
            "additionalProperties": False,
        },
        function=_run,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
        cache_ttl=0,
    )

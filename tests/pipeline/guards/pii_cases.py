"""A small labelled set for PII detection: the shapes the issue names (separators, lower-case
IBANs, obfuscated e-mail addresses) and look-alikes that must pass (dates, versions, paths,
IP-like numbers, prose with "at" and "dot", ISBNs, numbers that fail their checksum).

Each positive is (text, kind, value): the one finding the text must give. Each benign text must
give no finding at all. `test_pii_detection.py` measures recall and the false-positive rate.
"""

from __future__ import annotations

POSITIVES: list[tuple[str, str, str]] = [
    # Cards, any common separator, mixed too.
    ("card 4111.1111.1111.1111 exp 12/29", "card", "4111.1111.1111.1111"),
    ("card 4111/1111/1111/1111", "card", "4111/1111/1111/1111"),
    ("number: 4111_1111_1111_1111.", "card", "4111_1111_1111_1111"),
    ("pay with 4111-1111.1111 1111", "card", "4111-1111.1111 1111"),
    ("mastercard 5500.0055.5555.5559", "card", "5500.0055.5555.5559"),
    ("amex 3782/822463/10005", "card", "3782/822463/10005"),
    ("amex 3782.822463.10005 please", "card", "3782.822463.10005"),
    ("visa 4012_8888_8888_1881", "card", "4012_8888_8888_1881"),
    ("discover 6011-1111-1111-1117", "card", "6011-1111-1111-1117"),
    ("card no. 5105-1051-0510-5100", "card", "5105-1051-0510-5100"),
    ("new card 2223 0031 2200 3222", "card", "2223 0031 2200 3222"),
    ("jcb 3530.1113.3330.0000", "card", "3530.1113.3330.0000"),
    ("4111111111111111", "card", "4111111111111111"),
    # IBANs: lower and mixed case, every separator.
    ("iban de89 3704 0044 0532 0130 00 thanks", "iban", "de89 3704 0044 0532 0130 00"),
    ("IBAN DE89.3704.0044.0532.0130.00", "iban", "DE89.3704.0044.0532.0130.00"),
    ("IBAN DE89/3704/0044/0532/0130/00", "iban", "DE89/3704/0044/0532/0130/00"),
    ("IBAN DE89_3704_0044_0532_0130_00", "iban", "DE89_3704_0044_0532_0130_00"),
    ("iban: De89-3704-0044-0532-0130-00", "iban", "De89-3704-0044-0532-0130-00"),
    ("to gb82 west 1234 5698 7654 32 today", "iban", "gb82 west 1234 5698 7654 32"),
    ("GB82-WEST-1234-5698-7654-32", "iban", "GB82-WEST-1234-5698-7654-32"),
    ("account gb29nwbk60161331926819", "iban", "gb29nwbk60161331926819"),
    ("nl91 abna 0417 1643 00", "iban", "nl91 abna 0417 1643 00"),
    ("conta fr14 2004 1010 0505 0001 3m02 606", "iban", "fr14 2004 1010 0505 0001 3m02 606"),
    ("es91 2100 0418 4502 0005 1332", "iban", "es91 2100 0418 4502 0005 1332"),
    ("it60 x054 2811 1010 0000 0123 456", "iban", "it60 x054 2811 1010 0000 0123 456"),
    ("be68.5390.0754.7034", "iban", "be68.5390.0754.7034"),
    ("NIB PT50 0002 0123 1234 5678 9015 4", "iban", "PT50 0002 0123 1234 5678 9015 4"),
    ("ch93-0076-2011-6238-5295-7", "iban", "ch93-0076-2011-6238-5295-7"),
    # E-mail addresses written out.
    ("mail john [at] example [dot] com", "email", "john [at] example [dot] com"),
    ("john(at)example(dot)com", "email", "john(at)example(dot)com"),
    ("john {at} example {dot} org", "email", "john {at} example {dot} org"),
    ("john <at> example <dot> net", "email", "john <at> example <dot> net"),
    (
        "jd [at] mail [dot] example [dot] co [dot] uk",
        "email",
        "jd [at] mail [dot] example [dot] co [dot] uk",
    ),
    ("jane.doe at example dot com", "email", "jane.doe at example dot com"),
    ("write to j.smith at company dot org", "email", "j.smith at company dot org"),
    ("email: ana at exemplo dot pt", "email", "ana at exemplo dot pt"),
    ("maria @ example . com", "email", "maria @ example . com"),
    ("name[at]example[dot]com", "email", "name[at]example[dot]com"),
    ("NAME [AT] EXAMPLE [DOT] COM", "email", "NAME [AT] EXAMPLE [DOT] COM"),
    ("support [at] example.com", "email", "support [at] example.com"),
    ("ping bob@example [dot] io", "email", "bob@example [dot] io"),
    ("contact me at bob at example dot com", "email", "bob at example dot com"),
    ("user123 at gmail dot com", "email", "user123 at gmail dot com"),
    ("rui_silva at empresa dot com dot br", "email", "rui_silva at empresa dot com dot br"),
    ("ana (at) example (dot) com", "email", "ana (at) example (dot) com"),
    ("ana [ at ] example [ dot ] com", "email", "ana [ at ] example [ dot ] com"),
    ("ana[@]example[.]com", "email", "ana[@]example[.]com"),
    ("sales at acme dot io", "email", "sales at acme dot io"),
    ("john at example dot com", "email", "john at example dot com"),
    ("mail ana@example.com", "email", "ana@example.com"),
]

BENIGN: list[str] = [
    # Dates and times.
    "due 2024.01.02", "on 01/02/2024", "15.03.2023 at 10:30", "2024/12/31", "2023-11-05 14:30",
    "from 2024.01.02 12.30.45 to 2024.01.03 08.00.00",
    # Versions and build numbers.
    "v1.2.3.4", "Windows 10.0.19041.1234", "version 4.18.0.240", "Python 3.11.7",
    "release 2024.10.1.3456.7", "kernel 5.15.0-1049-azure",
    # File paths.
    "/usr/lib/x86_64-linux-gnu/libc.so.6", "C:/Program Files/App/1234/5678",
    "src/2024/01/report_2024_01_02.txt", "logs/4111/1111/run_12_34.log",
    # IP-like numbers that are no addresses.
    "OID 1.3.6.1.4.1.2021.10", "999.1.1.1 is not an address", "1.2.3.4.5",
    # ISBNs.
    "ISBN 978-3-16-148410-0", "ISBN 978.3.16.148410.0", "ISBN 0-306-40615-2",
    "ISBN 9783161484100",
    # Prose with "at" and "dot".
    "meet at the dot com bubble", "I work at google dot com", "we met at noon today",
    "look at the dot on the map", "arrive at home dot", "send it at once",
    "click the dot (at the top)", "the bug [at] line 12", "see [at] the end", "[dot] product",
    "a @ b", "an @ mention", "email me at the office", "I'm at the office, dot your i's",
    "sold at amazon dot com", "look at example dot com", "shop at example dot com for deals",
    "RFC 2822 at www dot ietf dot org", "see chapter 3 at page dot com",
    "item #4 at store dot com", "notes.md at home dot txt", "log in at portal dot example dot com",
    "our team at acme dot com builds", "I bought it at target dot com",
    "data at rest dot encryption",
    # Numbers that fail their checks, or are too short.
    "order 4111-1111-1111-1112", "serial 1234_5678_9012_3456", "10/20/30/40/50/60/70/80",
    "3.14159265358979", "1234.5678.9012", "de 12 de maio", "code de12 3456",
    "gb82 west", "at.dot.com", "ab12 cd34 ef56 gh78 ij90 kl", "DE89 3704 0044 0532 0130 01",
    "de89 3704 0044 0532 0130",
    "pi is 3.4111111111111111",
    "4111111111111111.5 metres", "4111.1111.1111.111", "41.11.11.11.11.11.11.11",
]  # fmt: skip

# Written after the rules above were settled and measured once, without changing the rules:
# a small held-out check of the same shapes (the kind of the one finding each must give).
HELD_OUT_POSITIVES: list[tuple[str, str]] = [
    ("my iban is pt50.0002.0123.1234.5678.9015.4", "iban"), ("Card: 5555/5555/5555/4444", "card"),
    ("cc 4242_4242_4242_4242", "card"), ("email: maria.santos (at) gmail (dot) com", "email"),
    ("contact: joao {at} empresa {dot} pt", "email"),
    ("reach me at sam_k at proton dot me", "email"),
    ("bob[at]corp[dot]io", "email"), ("Mail: first.last @ domain . org", "email"),
    ("IBAN: GB33BUKB20201555555555", "iban"), ("gb33 bukb 2020 1555 5555 55", "iban"),
    ("amex 3714-496353-98431", "card"), ("write to ops-team at acme dot co dot uk", "email"),
    ("ES91-2100-0418-4502-0005-1332", "iban"), ("visa 4000 0566 5566 5556", "card"),
    ("luis at example dot org", "email"), ("kim (AT) mail (DOT) net", "email"),
]  # fmt: skip
HELD_OUT_BENIGN: list[str] = [
    "Room 12 at the Hilton dot", "Tag @ the end . Done", "see (at) appendix",
    "score was 4 at half time dot", "10/12/2023 14:30", "path/to/file_2023_11_05.log",
    "meet me at noon dot", "we are at version 10.0.4111.1111", "table 4.1111.2222",
    "Look at me dot com style", "it sells at 99.99 dot", "ratio 1111/2222/3333/4444",
    "phone bill at home dot", "He works at ibm dot", "Stay at the hotel (at) night",
    "coords 40.7128/-74.0060", "id 2023_0001_0002_0003", "at at at dot dot",
]  # fmt: skip

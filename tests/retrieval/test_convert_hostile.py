"""Files built to make the converters read a server file or reach the network: external
entities, XInclude, external and path-walking relationships, HTML that names other resources.

Each is converted as an upload is (``convert``), with a marker file on disk as the ``file://``
target and a listener on 127.0.0.1 as the ``http://`` one: the file may be refused or read, but
its text never holds the marker and nothing connects. Today this holds because of choices made
in the libraries below us (mammoth's ``external_file_access`` off by default since 1.12.2,
python-pptx's parser without entity resolution, expat dropping external entities); these tests
are what says so if an upgrade changes one."""

from __future__ import annotations

import base64
import io
import socket
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrieval.files import FileRejected, convert

MARKER = "SERVERFILE7F3A"
ENCODED = base64.b64encode(MARKER.encode()).decode()[:16]
RELS = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
NAMESPACES = (
    f'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" xmlns:r="{RELS}"'
)
CONTENT_TYPES = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" '
    'ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="xml" ContentType="application/xml"/>'
    '<Override PartName="/word/document.xml" ContentType="application/'
    'vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>'
)
ROOT_RELS = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
    f'<Relationship Id="rId1" Type="{RELS}/officeDocument" Target="word/document.xml"/>'
    "</Relationships>"
)


class Listener:
    """Counts the connections made to a port on 127.0.0.1, and hangs up on each at once: a
    converter that fetched (mammoth's ``urlopen`` has no timeout) fails this test at once
    instead of waiting for an answer, as it would on ``SilentServer``."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def secret(tmp_path: Path) -> str:
    path = tmp_path / "secret.txt"
    path.write_text(MARKER + "\n")
    return f"file://{path}"


def zipped(members: dict[str, str | bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def docx(
    body: str, *, prolog: str = "", relations: str = "", parts: dict[str, str] | None = None
) -> bytes:
    document = (
        f'<?xml version="1.0" encoding="UTF-8"?>{prolog}'
        f"<w:document {NAMESPACES}><w:body>{body}</w:body></w:document>"
    )
    members: dict[str, str | bytes] = {
        "[Content_Types].xml": CONTENT_TYPES,
        "_rels/.rels": ROOT_RELS,
        "word/document.xml": document,
    }
    if relations:
        members["word/_rels/document.xml.rels"] = (
            '<?xml version="1.0"?><Relationships '
            f'xmlns="http://schemas.openxmlformats.org/package/2006/relationships">{relations}'
            "</Relationships>"
        )
    members.update(parts or {})
    return zipped(members)


def relation(kind: str, target: str, *, external: bool = True) -> str:
    mode = ' TargetMode="External"' if external else ""
    return f'<Relationship Id="rId9" Type="{RELS}/{kind}" Target="{target}"{mode}/>'


def paragraph(text: str) -> str:
    return f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>"


def picture(attribute: str) -> str:
    return (
        "<w:p><w:r><w:drawing><wp:inline xmlns:wp="
        '"http://schemas.openxmlformats.org/drawingml/2006/wordprocessingDrawing">'
        '<wp:docPr id="1" name="P" descr="alt"/>'
        '<a:graphic xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main">'
        '<a:graphicData uri="http://schemas.openxmlformats.org/drawingml/2006/picture">'
        '<pic:pic xmlns:pic="http://schemas.openxmlformats.org/drawingml/2006/picture">'
        f"<pic:blipFill><a:blip {attribute}/></pic:blipFill></pic:pic></a:graphicData>"
        "</a:graphic></wp:inline></w:drawing></w:r></w:p>" + paragraph("after the picture")
    )


def hostile_files(secret: str, url: str) -> dict[str, tuple[str, bytes]]:
    entity = f'<!DOCTYPE w:document [<!ENTITY e SYSTEM "{secret}"><!ENTITY h SYSTEM "{url}/e">]>'
    styles = (
        '<?xml version="1.0"?>'
        f'<!DOCTYPE w:styles [<!ENTITY e SYSTEM "{secret}"><!ENTITY h SYSTEM "{url}/s">]>'
        f'<w:styles {NAMESPACES}><w:style w:type="paragraph" w:styleId="Heading1">'
        '<w:name w:val="heading 1 &e;&h;"/></w:style></w:styles>'
    )
    comments = (
        f'<?xml version="1.0"?><!DOCTYPE w:comments [<!ENTITY e SYSTEM "{secret}">]>'
        f'<w:comments {NAMESPACES}><w:comment w:id="0"><w:p><w:r><w:t>note &e;</w:t></w:r>'
        "</w:p></w:comment></w:comments>"
    )
    walk_up = "../" * 12 + secret.removeprefix("file:///")
    article = "An ordinary paragraph of article text, long enough to be kept as content. " * 3
    page = (
        f'<!DOCTYPE html><html><head><base href="{url}/base/">'
        f'<link rel="stylesheet" href="{url}/css"><script src="{url}/js"></script>'
        f'<meta http-equiv="refresh" content="0;url={url}/refresh"></head><body><article>'
        f'<h1>Title</h1><p>{article}</p><iframe src="{secret}"></iframe>'
        f'<iframe src="{url}/frame"></iframe><img src="{url}/img.png" alt="x"><img src="{secret}">'
        f'<object data="{secret}"></object><p>{article}</p></article></body></html>'
    )
    xhtml = (
        f'<?xml version="1.0"?><!DOCTYPE html [<!ENTITY e SYSTEM "{secret}">'
        f'<!ENTITY % p SYSTEM "{url}/p"> %p;]><html xmlns="http://www.w3.org/1999/xhtml">'
        f"<body><article><p>{article} [&e;]</p></article></body></html>"
    )
    xinclude = (
        '<w:p><w:r><w:t><xi:include xmlns:xi="http://www.w3.org/2001/XInclude" '
        f'href="{secret}" parse="text"/></w:t></w:r></w:p>' + paragraph("tail")
    )
    return {
        "docx: an external entity in the document": (
            "a.docx",
            docx(paragraph("A &e; &h; B"), prolog=entity),
        ),
        "docx: external entities in the styles and comments": (
            "a.docx",
            docx(
                paragraph("body"),
                relations=relation("styles", "styles.xml", external=False)
                + relation("comments", "comments.xml", external=False).replace("rId9", "rId8"),
                parts={"word/styles.xml": styles, "word/comments.xml": comments},
            ),
        ),
        "docx: XInclude of a file": ("a.docx", docx(xinclude)),
        "docx: a linked picture on disk": (
            "a.docx",
            docx(picture('r:link="rId9"'), relations=relation("image", secret)),
        ),
        "docx: a linked picture on the network": (
            "a.docx",
            docx(picture('r:link="rId9"'), relations=relation("image", f"{url}/p.png")),
        ),
        "docx: an embedded picture that walks up the tree": (
            "a.docx",
            docx(picture('r:embed="rId9"'), relations=relation("image", walk_up, external=False)),
        ),
        "docx: an external altChunk and subDoc": (
            "a.docx",
            docx(
                paragraph("x") + '<w:altChunk r:id="rId9"/><w:p><w:subDoc r:id="rId8"/></w:p>',
                relations=relation("aFChunk", f"{url}/alt")
                + relation("subDocument", secret).replace("rId9", "rId8"),
            ),
        ),
        "html: frames, pictures, objects, styles and scripts elsewhere": (
            "a.html",
            page.encode(),
        ),
        "html: an XHTML page with external entities": ("a.html", xhtml.encode()),
        "markdown: a picture and a link to a file": (
            "a.md",
            f"# T\n\n![x]({secret}) [y]({url}/y)\n\n<iframe src='{secret}'></iframe>\n".encode(),
        ),
    }


CASES = list(hostile_files("file:///x", "http://127.0.0.1:1"))


@pytest.mark.parametrize("case", CASES)
def test_a_file_cannot_make_the_converter_read_a_server_file_or_reach_the_network(
    case: str, secret: str, listener: Listener
) -> None:
    filename, data = hostile_files(secret, listener.url)[case]
    try:
        text = convert(filename, data).text
    except FileRejected:
        text = ""  # refused is fine: nothing of the file's targets was read into an answer
    assert MARKER not in text and ENCODED not in text  # as text, or a picture's data URI
    assert listener.connections == 0

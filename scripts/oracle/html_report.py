"""Reads an HTML report with Python's own parsers and prints what it holds as JSON.

    python scripts/oracle/html_report.py REPORT.html

Output (one JSON document on stdout):
- `document_is_xml`: the whole page parses with xml.etree (the report is polyglot HTML/XML);
- `svgs`: per `<svg>` element in document order (each cut out of the text and parsed alone
  with xml.etree): `id`, `error` (null when well-formed), and `marks`, every element inside
  with a class other than the axes' (`grid`, `tick`, `frame`, `axis-label`): `tag`, `class`,
  its attributes and its `<title>` text;
- `tables`: per `<table id=...>`, the rows of cell texts (header row first);
- `urls`: every `src`, `href` and `xlink:href` value and every CSS `url(...)`, seen by
  html.parser;
- `scripts`, `links`: counts of `<script>` and `<link>` elements;
- `title`: the text of `<title>` in the head; `ids`: every element id.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

SVG = "{http://www.w3.org/2000/svg}"
AXES = {"grid", "tick", "frame", "axis-label"}


class Collector(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.urls, self.ids = [], []
        self.scripts = self.links = 0
        self.tables, self.table, self.row, self.cell = {}, None, None, None
        self.in_head_title, self.title = False, ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href", "xlink:href"):
            if k in a:
                self.urls.append(a[k])
        self.urls += re.findall(r"url\(([^)]*)\)", a.get("style") or "")
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "script":
            self.scripts += 1
        if tag == "link":
            self.links += 1
        if tag == "title" and not self.title:
            self.in_head_title = True
        if tag == "table":
            self.table = a.get("id")
            self.tables[self.table] = []
        elif tag == "tr" and self.table is not None:
            self.row = []
        elif tag in ("td", "th") and self.row is not None:
            self.cell = ""

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_head_title = False
        if tag in ("td", "th") and self.cell is not None:
            self.row.append(self.cell)
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.tables[self.table].append(self.row)
            self.row = None
        elif tag == "table":
            self.table = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data
        if self.in_head_title:
            self.title += data
        self.urls += re.findall(r"url\(([^)]*)\)", data)


def marks(svg):
    out = []
    for el in svg.iter():
        cls = el.get("class")
        if cls is None or cls in AXES:
            continue
        title = el.find(SVG + "title")
        out.append({
            "tag": el.tag.replace(SVG, ""),
            "class": cls,
            "attrs": {k: v for k, v in el.attrib.items()},
            "title": title.text if title is not None else None,
        })
    return out


def main(path):
    text = open(path, encoding="utf-8").read()
    try:
        ET.fromstring(text.split("\n", 1)[1] if text.startswith("<!DOCTYPE") else text)
        document_is_xml = True
    except ET.ParseError:
        document_is_xml = False
    svgs = []
    for m in re.finditer(r"<svg\b.*?</svg>", text, re.S):
        try:
            root = ET.fromstring(m.group(0))
            svgs.append({"id": root.get("id"), "error": None, "marks": marks(root)})
        except ET.ParseError as e:
            svgs.append({"id": None, "error": str(e), "marks": []})
    c = Collector()
    c.feed(text)
    c.close()
    json.dump({
        "document_is_xml": document_is_xml,
        "svgs": svgs,
        "tables": c.tables,
        "urls": c.urls,
        "scripts": c.scripts,
        "links": c.links,
        "title": c.title,
        "ids": c.ids,
    }, sys.stdout)


main(sys.argv[1])

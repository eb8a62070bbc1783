"""The trajectory viewer: one self-contained page, one section per trajectory, text escaped, tool calls and
answers highlighted. Checked on the rendered HTML with a stdlib parser and, where Debian's chromium is installed,
in a real headless browser (its DOM after parsing, and a screenshot)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.env import ToolCall
from agentrl.rollout import Trajectory
from agentrl.view import render, write_viewer
from tests.children import Child, run_child

NASTY = 'Is 3 < 4 && 5 > 2? <script>alert("pwned")</script> <b>not bold</b> &amp; \'quoted\''
CALL = '<tool_call>{"name": "search", "arguments": {"query": "Paris & <Lyon>"}}</tool_call>'
RESULT = '[1] <i>Paris</i>\nParis is the capital of France. </div><img src=x onerror=alert(1)>'
FINAL = 'It is <answer>Paris & "Lyon"</answer>'
CUT = '<tool_call>{"name": "search", "arguments": {"query": "unfinish'  # a call cut off by the length limit



def records() -> list[dict]:
    first = Trajectory(prompt_index=7, epoch=0, group_id=0, turn_spans=[(10, 20), (30, 40)], reward=1.0,
                       reward_components={"answer_f1": 1.0, "answer_em": 0.0}, finish_reason="done",
                       answer=FINAL, gold='Paris <&> "Lyon"')
    first.messages = [
        {"role": "system", "content": "Use <tools> wisely."},
        {"role": "user", "content": NASTY},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "search", "content": RESULT},
        {"role": "assistant", "content": FINAL},
    ]
    first.tool_calls = [ToolCall(turn=0, name="search", arguments={"query": "Paris & <Lyon>"}, status="ok",
                                 content=RESULT)]
    second = Trajectory(prompt_index=3, epoch=1, group_id=1, turn_spans=[(5, 9)], reward=0.0,
                        finish_reason="length")
    second.messages = [{"role": "user", "content": "Plain question"}, {"role": "assistant", "content": CUT}]
    second.tool_calls = [ToolCall(turn=0, name="", arguments={}, status="parse_error", content="Error")]
    third = Trajectory(prompt_index=1, epoch=0, group_id=2, turn_spans=[(3, 4)], reward=0.5, finish_reason="done")
    third.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<answer>yes</answer>"}]
    return [json.loads(json.dumps(t.to_json())) for t in (first, second, third)]  # as the JSONL holds them


# ------------------------------------------------------------------------------------------------ a small DOM
VOID = {"meta", "br", "img", "hr", "input", "link"}


class Node:
    def __init__(self, tag: str, attrs: dict, parent: "Node | None"):
        self.tag, self.attrs, self.parent, self.children = tag, attrs, parent, []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        for c in self.children:
            if isinstance(c, Node):
                yield c
                yield from c.iter()

    def find(self, tag: str | None = None, cls: str | None = None) -> list["Node"]:
        return [n for n in self.iter() if (tag is None or n.tag == tag) and (cls is None or cls in n.classes)]


class DomBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.node = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.node)
        self.node.children.append(node)
        if tag not in VOID:
            self.node = node

    def handle_endtag(self, tag):
        node = self.node
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.node = node.parent

    def handle_data(self, data):
        self.node.children.append(data)


def parse(html: str) -> Node:
    builder = DomBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


def message_text(msg: Node) -> str:
    """A message's content: its text without the role label."""
    return "".join(c if isinstance(c, str) else c.text() for c in msg.children
                   if isinstance(c, str) or "role" not in c.classes)


def check_page(root: Node) -> None:
    """What the page must show, whoever parsed it."""
    assert root.find("script") == [] and root.find("img") == [] and root.find("i") == []
    sections = root.find("section", "traj")
    assert len(sections) == 3
    assert [s.attrs.get("data-index") for s in sections] == ["0", "1", "2"]
    assert "3 trajectories" in root.find("p")[0].text() and "mean reward 0.500" in root.find("p")[0].text()

    first, second, third = sections
    msgs = first.find("div", "msg")
    assert [sorted(m.classes - {"msg"}) for m in msgs] == [["system"], ["user"], ["assistant"], ["tool"], ["assistant"]]
    assert [message_text(m) for m in msgs] == ["Use <tools> wisely.", NASTY, CALL, RESULT, FINAL]
    assert first.find("b") == [] and msgs[1].find() == [msgs[1].find("span", "role")[0]]  # no markup from text
    assert [c.text() for c in first.find("span", "call")] == [CALL]
    assert [a.text() for a in first.find("span", "answer")] == ['<answer>Paris & "Lyon"</answer>']
    assert msgs[3].find("span", "role")[0].text().split() == ["tool", "·", "search"]
    head = first.find("div", "head")[0].text()
    assert "prompt 7" in head and "reward 1.000" in head and 'gold: Paris <&> "Lyon"' in head
    assert "answer_f1=1.000" in first.text()
    calls = first.find("details")[0]
    assert "1 tool calls" in calls.find("summary")[0].text()
    assert '"Paris & <Lyon>"' in calls.text().encode().decode("unicode_escape")
    assert [s.text() for s in calls.find("span", "status-ok")] == ["ok"]

    assert [c.text() for c in second.find("span", "call")] == [CUT]  # an unclosed call runs to the end
    assert second.find("span", "answer") == []
    assert "zero" in second.find("span", "reward")[0].classes
    assert [s.text() for s in second.find("span", "status-err")] == ["parse_error"]

    assert [a.text() for a in third.find("span", "answer")] == ["<answer>yes</answer>"]
    assert third.find("span", "call") == [] and third.find("details") == []


# ------------------------------------------------------------------------------------------------ without a browser
def test_rendered_page_structure_and_escaping():
    html = render(records())
    assert "<script>" not in html and NASTY not in html  # the raw text never reaches the page as markup
    assert "&lt;script&gt;alert(&#34;pwned&#34;)&lt;/script&gt;" in html
    check_page(parse(html))


def test_write_viewer_and_the_view_command(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records()) + "\n")
    page = write_viewer(results)
    assert page == tmp_path / "results.html"
    check_page(parse(page.read_text()))
    out = tmp_path / "elsewhere.html"
    assert main(["view", str(results), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_text() == page.read_text()


def test_an_empty_results_file_gives_an_empty_page(tmp_path):
    results = tmp_path / "empty.jsonl"
    results.write_text("")
    root = parse(write_viewer(results).read_text())
    assert root.find("section") == [] and "0 trajectories" in root.find("p")[0].text()


# ------------------------------------------------------------------------------------------------ in a browser
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium): the browser checks need it")
    return found


def browse(tmp_path: Path, page: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
               f"--user-data-dir={tmp_path / 'profile'}", *flags, page.resolve().as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("viewer") / "trajectories.html"
    path.write_text(render(records()))
    return path


def test_browser_dom_holds_sections_highlights_and_escaped_text(page, tmp_path):
    dom = browse(tmp_path, page, "--dump-dom").stdout
    assert "<section" in dom, dom[:500]
    check_page(parse(dom))


def test_browser_screenshot_shows_the_page(page, tmp_path):
    from PIL import Image  # matplotlib's dependency

    shot = tmp_path / "page.png"
    browse(tmp_path, page, f"--screenshot={shot}", "--window-size=1000,1400", "--hide-scrollbars")
    assert shot.stat().st_size > 1000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(shot) as image:
        assert image.size == (1000, 1400)
        colors = {rgb for _, rgb in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert len(colors) > 20  # text, not a blank page
    # the highlight backgrounds of the tool call (#e8f0ff) and the answer (#e6f7ea) were painted
    for want in ((0xE8, 0xF0, 0xFF), (0xE6, 0xF7, 0xEA)):
        assert any(max(abs(a - b) for a, b in zip(rgb, want)) <= 2 for rgb in colors), want


# The eval as a user types it, in a child process started ahead of the test (tests.helpers, "children started
# ahead"): its minute of CPU overlaps the tests before it. It writes into a folder of its own, moved to tmp_path.
EVAL_DIR = Path(tempfile.gettempdir()) / f"agentrl-tests-eval-{os.getpid()}"
EMBEDDED_EVAL = Child((sys.executable, "-m", "agentrl", "eval", "hotpotqa_search", "--limit", "3",
                       "--max-new-tokens", "48", "--out", "results.jsonl"), EVAL_DIR, (("OMP_NUM_THREADS", "1"),),
                      timeout_s=600)


@pytest.mark.slow
@pytest.mark.child(EMBEDDED_EVAL)
def test_embedded_model_eval_then_view_renders_in_the_browser(tmp_path):
    """The issue's path end to end: `agentrl eval hotpotqa_search` on the embedded SmolLM2 (CPU, through the
    driver and the engine), `agentrl view`, and the page opened in a real browser."""

    done = run_child(EMBEDDED_EVAL)
    out = tmp_path / "results.jsonl"
    if (EVAL_DIR / "results.jsonl").exists():
        shutil.move(EVAL_DIR / "results.jsonl", out)
    shutil.rmtree(EVAL_DIR, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["n"] == 3 and summary["model"] == "smollm2-135m-instruct"
    assert main(["view", str(out)]) == 0
    dom = browse(tmp_path, out.with_suffix(".html"), "--dump-dom").stdout
    root = parse(dom)
    sections = [n for n in root.iter() if n.tag == "section"]
    assert len(sections) == 3
    assert "3 trajectories" in dom

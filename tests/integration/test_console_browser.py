"""The web console in a real browser (Debian's headless Chromium, Selenium) against a real
server and console: each page's content equals the store's, navigation works, auth
refuses, untrusted text stays text. Screenshots: test-artifacts/console/*.png."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from urllib.parse import urlencode

import pytest

from expstore.synthetic import trajectories
from expstore_client import Client
from expstore_rl.rewards import exact_match
from expstore_rl.tokenizer import CharTokenizer

from . import _browser as browser
from ._console import GROUP_SIZE, TOKENIZER, agent_rows, generated, start_console

pytestmark = pytest.mark.slow
REWARD = "expstore_rl.rewards:exact_match"
PAYLOADS = ['<script>window.__xss = 1</script>', '"><img src=x onerror="window.__xss = 2">',
            "<svg onload=window.__xss=3>", "javascript:window.__xss=4", "<b>bold</b>&amp;"]
NO_MARKUP = """return [window.__xss === undefined,
    document.querySelectorAll('[onerror], [onload], main img, main script, main iframe').length +
    [...document.querySelectorAll('main b')].filter((b) => b.textContent === 'bold').length]"""


def xss_rows() -> list[dict]:
    """Every string column of agent rows carrying markup."""
    rows = agent_rows(prefix="x")[:8]
    for i, r in enumerate(rows):
        p = PAYLOADS[i % len(PAYLOADS)]
        r.update(traj_id=f"{p} #{i}", prompt_id=p, group_id=f"g {PAYLOADS[1]}", task=PAYLOADS[0],
                 finish_reason=PAYLOADS[(i + 1) % len(PAYLOADS)], metadata=json.dumps({"answer": "321", "note": p}),
                 reward_components={PAYLOADS[1]: 1.0, PAYLOADS[2]: 0.5})
        r["turns"][1].update(tool_name=PAYLOADS[2], tool_args=PAYLOADS[1], tool_result=PAYLOADS[0], tool_status=p)
    return rows


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from ._util import start_server

    s = start_server(tmp_path_factory.mktemp("console-browser") / "data")
    c = Client(s.address)
    rows = agent_rows()
    c.create_table("agent", metadata={"tokenizer": TOKENIZER})
    c.insert("agent", rows)
    c.sample("agent", 6, step=7)
    c.create_table("rollouts", sampler={"type": "prioritized", "alpha": 0.6, "beta": 0.4})
    c.insert("rollouts", trajectories(256, tokens=64))
    c.sample("rollouts", 64)
    c.create_table("queue", sampler="fifo")
    c.insert("queue", trajectories(10, id_prefix="q"))
    next(iter(c.stream("queue", group="trainer", batch_size=4, idle_timeout=1.0)))
    c.create_table("xss", metadata={"tokenizer": TOKENIZER})
    c.insert("xss", xss_rows())
    console = start_console(s.address, "--reward", REWARD, "--audit-workers", "1")
    driver = browser.chrome()
    yield s, c, rows, console.url, driver
    browser.quit(driver)
    console.stop()
    c.close()
    s.stop()


def open_page(driver, url: str, ready: str):
    driver.get(url)
    return browser.wait_for(driver, ready)


def text_of(driver, css: str) -> str:
    return driver.find_element("css selector", css).text


def test_tables_page_shows_the_stores_numbers(site):
    s, c, _, url, d = site
    open_page(d, url + "/", '[data-table="queue"][data-group="trainer"][data-k="lag"]')
    stats = c.stats()
    for name in ("agent", "rollouts", "queue"):
        assert text_of(d, f'b[data-table="{name}"][data-k="items"]') == f"{int(stats[name]['items']):,}"
        for tier in ("memory", "ssd"):
            assert text_of(d, f'span[data-table="{name}"][data-tier="{tier}"][data-k="items"]') == \
                f"{int(stats[name][f'items_{tier}']):,}"
    assert text_of(d, '[data-table="queue"][data-group="trainer"][data-k="lag"]') == "6"
    assert text_of(d, '[data-table="queue"][data-group="trainer"][data-k="unacked"]') == "4"
    assert d.execute_script("return document.querySelectorAll('section.card .main-svg').length") > 0  # plots drawn
    browser.screenshot(d, "tables")
    assert browser.errors(d) == []


def test_sql_page_runs_pages_and_links_items(site):
    s, c, _, url, d = site
    open_page(d, url + "/sql", "#sql")
    box = d.find_element("css selector", "#sql")
    box.clear()
    box.send_keys("SELECT item_id, traj_id, reward FROM rollouts ORDER BY item_id")
    d.find_element("css selector", "#run").click()
    browser.wait_for(d, "#row-count")
    expected = c.query_table("SELECT item_id, traj_id FROM rollouts ORDER BY item_id")
    assert text_of(d, "#row-count") == f"{expected.num_rows} rows"
    cells = [e.text for e in d.find_elements("css selector", "#result tbody tr td:nth-child(2)")]
    assert cells == expected.column("traj_id").to_pylist()[:100]
    d.find_element("xpath", "//button[contains(., 'Next')]").click()
    browser.wait_until(d, lambda d: text_of(d, "#page-info") == "page 2 of 3")
    first = d.find_element("css selector", "#result tbody tr td a")
    assert first.text == str(expected.column("item_id")[100].as_py())
    assert "/item?table=rollouts&id=" in first.get_attribute("href")
    assert "format=parquet" in d.find_element("css selector", "#download-parquet").get_attribute("href")
    browser.screenshot(d, "sql")


def test_a_manifest_leads_to_its_trajectories(site):
    s, c, rows, url, d = site
    open_page(d, url + "/manifest?table=agent&step=7", "#manifest-summary")
    ids, _ = c.manifest("agent", 7)
    assert text_of(d, "#manifest-summary").startswith(f"step 7 of agent: {len(ids)} draws")
    links = d.find_elements("css selector", "#manifest tbody tr td:first-child a")
    assert [int(a.text) for a in links] == ids.tolist()
    browser.screenshot(d, "manifest")
    links[0].click()
    browser.wait_for(d, "#turns .segment")
    item_id = int(ids[0])
    assert d.find_element("css selector", "h1").text.startswith(f"Item {item_id} of agent")
    row = c.query_table(f"SELECT traj_id FROM agent WHERE item_id = {item_id}").column(0)[0].as_py()
    r = next(x for x in rows if x["traj_id"] == row)
    assert text_of(d, "#tokenizer-note").startswith(f"decoded with {TOKENIZER}")
    spans = d.find_elements("css selector", "#turns .tok")
    assert len(spans) == len(r["tokens"])
    assert "".join(s.text for s in spans).replace(" ", "") == \
        CharTokenizer().decode(r["tokens"]).replace(" ", "")
    assert text_of(d, ".tool-call .tool-result") == r["turns"][1]["tool_result"]
    assert text_of(d, '[data-k="reward"]') == format(r["reward"], "g")
    assert len(d.find_elements("css selector", "#siblings .sibling")) == GROUP_SIZE
    browser.screenshot(d, "item")
    d.find_element("css selector", "#siblings .sibling:not(.current) a").click()  # a sibling, in the viewer
    browser.wait_for(d, "#turns .segment")
    assert d.find_element("css selector", "h1").text != f"Item {item_id} of agent"
    assert browser.errors(d) == []


def test_items_and_a_zero_variance_group(site):
    s, c, rows, url, d = site
    open_page(d, url + "/items?table=agent&where=reward%20%3D%201&limit=200", "#items table")
    shown = d.find_elements("css selector", "#items tbody tr")
    assert len(shown) == sum(1 for r in rows if r["reward"] == 1)
    browser.screenshot(d, "items")
    open_page(d, url + "/group?table=agent&group_id=t-v1-g0", ".sibling")
    assert len(d.find_elements("css selector", ".sibling")) == GROUP_SIZE
    assert d.find_element("css selector", "#zero-variance").is_displayed()
    browser.screenshot(d, "group")


def test_an_audit_from_the_browser_links_its_offenders(site):
    s, c, rows, url, d = site
    open_page(d, url + "/audits?table=agent", "#run-audit")
    d.find_element("css selector", "#run-audit").click()
    browser.wait_for(d, '[data-k="mismatch"]', timeout=180)
    expected = Counter("ok" if exact_match(r).value == r["reward"] else "mismatch" for r in rows)
    assert text_of(d, '[data-k="mismatch"]') == str(expected["mismatch"])
    assert text_of(d, '[data-k="ok"]') == str(expected["ok"])
    browser.screenshot(d, "audit")
    offender = d.find_element("xpath", "//h3[.='Top offenders']/following-sibling::table//td/a")
    offender_id = offender.text
    offender.click()
    browser.wait_for(d, "#turns .segment")
    assert d.find_element("css selector", "h1").text.startswith(f"Item {offender_id} of agent")
    open_page(d, url + "/audits", "table.grid")
    assert len(d.find_elements("css selector", "table.grid tbody tr")) >= 1
    browser.screenshot(d, "audits")


def test_hacking_views_plot_the_stores_figures(site):
    s, c, rows, url, d = site
    open_page(d, url + "/hacking?table=agent", "#plot-tools .main-svg")
    for key in ("drift", "corr", "scatter", "collapse", "components", "finish", "tools"):
        assert d.execute_script(f"return document.querySelectorAll('#plot-{key} .main-svg').length") > 0, key
    versions = sorted({r["policy_version"] for r in rows})
    reward = d.execute_script("return document.getElementById('plot-drift').data[0].y")
    assert reward == pytest.approx([statistics.mean(r["reward"] for r in rows if r["policy_version"] == v)
                                    for v in versions])
    length = d.execute_script("return document.getElementById('plot-drift').data[1].y")
    assert length == pytest.approx([statistics.mean(generated(r) for r in rows if r["policy_version"] == v)
                                    for v in versions])
    collapse = d.execute_script("return document.getElementById('plot-collapse').data[0].y")
    assert collapse == pytest.approx([1 / 3] * len(versions))  # group 0 of 3 has equal rewards
    browser.screenshot(d, "hacking")
    assert browser.errors(d) == []


def test_untrusted_text_is_shown_as_text_everywhere(site):
    s, c, _, url, d = site
    ids = c.query_table("SELECT item_id FROM xss ORDER BY item_id").column(0).to_pylist()
    group = f"g {PAYLOADS[1]}"
    pages = [("/items?table=xss", "#items table"), (f"/item?table=xss&id={ids[1]}", "#turns .segment"),
             ("/group?" + urlencode({"table": "xss", "group_id": group}), ".sibling"),
             ("/sql?sql=SELECT%20*%20FROM%20xss", "#row-count"), ("/hacking?table=xss", "#plot-finish .main-svg"),
             ("/audits?table=xss", "#run-audit")]
    for path, ready in pages:
        open_page(d, url + path, ready)
        assert d.execute_script(NO_MARKUP) == [True, 0], path
        body = d.find_element("css selector", "main").text
        if path.startswith(("/items", "/item?", "/sql", "/group")):
            assert PAYLOADS[0] in body and PAYLOADS[1] in body, path
        browser.screenshot(d, "xss-" + path.strip("/").split("?")[0].replace("/", "-"))
    # an audit of the payload rows: task, traj_id and finish_reason come back in the report
    from selenium.webdriver.support.ui import Select

    Select(d.find_element("css selector", "select[name=table]")).select_by_visible_text("xss")
    d.find_element("css selector", "#run-audit").click()
    browser.wait_for(d, '[data-k="ok"]', timeout=180)
    report = d.find_element("css selector", "main").text
    assert d.execute_script(NO_MARKUP) == [True, 0]
    assert PAYLOADS[0] in report  # the task, in the split by task
    browser.screenshot(d, "xss-audit")
    open_page(d, url + "/hacking?table=xss", "#plot-finish .main-svg")
    svg = d.execute_script("return document.getElementById('plot-finish').textContent")
    assert PAYLOADS[1] in svg and PAYLOADS[4] in svg  # plotly shows finish_reasons as text, not as its markup
    assert d.execute_script(NO_MARKUP) == [True, 0]


def test_login_refuses_a_missing_or_wrong_token(server_factory):
    s = server_factory("""
        [auth]
        tokens = [{ name = "viewer", token = "reader-secret", roles = ["reader"] },
                  { name = "ops", token = "admin-secret", roles = ["admin"] }]
        """)
    with Client(s.address, "admin-secret") as admin:
        admin.create_table("agent", metadata={"tokenizer": TOKENIZER})
        admin.insert("agent", agent_rows()[:12])
    console = start_console(s.address)
    d = browser.chrome()
    try:
        open_page(d, console.url + "/", "#login")
        assert text_of(d, "#login-error") == \
            "UNAUTHENTICATED: missing bearer token: send metadata 'authorization: Bearer <token>'"
        assert d.find_elements("css selector", "section.card") == []
        browser.screenshot(d, "login")
        d.find_element("css selector", "#login-token").send_keys("wrong")
        d.find_element("css selector", "#login-submit").click()
        browser.wait_until(d, lambda d: text_of(d, "#login-error") == "UNAUTHENTICATED: unknown bearer token")
        field = d.find_element("css selector", "#login-token")
        field.clear()
        field.send_keys("reader-secret")
        d.find_element("css selector", "#login-submit").click()
        browser.wait_for(d, 'b[data-table="agent"][data-k="items"]')
        assert text_of(d, 'b[data-table="agent"][data-k="items"]') == "12"
        assert d.find_elements("css selector", "#login") == []
        browser.screenshot(d, "tables-after-login")
    finally:
        browser.quit(d)
        console.stop()

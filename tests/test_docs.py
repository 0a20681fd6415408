"""The user documentation stays true to the code (run by `make docs-check`, part of `make test`).

Each check is a function of text (or parsed data) that returns a list of problems, so that the
self-checks at the bottom can feed it a planted bad document and show that it fails:

- every configuration field of `filter-config/schema.json` is in `docs/configuration.md`;
- every metric the module emits (the names in `src/`) is in the metrics reference,
  `docs/observability.md`;
- every `make X` named in the docs is a Makefile target;
- every relative link and `#anchor` resolves (GitHub heading slugs);
- every repository path named in backticks (`src/...`, `tools/...`, ...) exists;
- every configuration shown in a ```json block with a `"version"` is one of
  `filter-config/examples/` (which `tests/config_examples.rs` validates);
- no user doc carries the project's issue numbers, session or branch talk, or commit hashes;
- the Grafana dashboard is valid JSON and queries only metrics the module (or Envoy) exports.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG_REFERENCE = ROOT / "docs" / "configuration.md"
METRICS_REFERENCE = ROOT / "docs" / "observability.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "inference-picker.json"


def user_docs() -> list[Path]:
    """The documents a user reads. (Files owned by generators are included: they must be true too.)"""
    files = [ROOT / "README.md", ROOT / "filter-config" / "README.md",
             ROOT / "tools" / "replay-bench" / "FINDINGS.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted(p for p in (ROOT / "envoy").rglob("README*") if p.is_file())
    files += sorted((ROOT / "tools").glob("*/README.md"))
    return [f for f in files if f.is_file()]


# ---------------------------------------------------------------------------------------------
# Markdown helpers

FENCE = re.compile(r"^(\s*)(```|~~~)")


def split_fenced(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """(prose lines with their 1-based numbers, fenced blocks as (info string, body))."""
    prose, blocks = [], []
    in_block, info, body = False, "", []
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if in_block:
                blocks.append((info, "\n".join(body)))
                in_block, body = False, []
            else:
                in_block, info = True, line.strip().strip("`~").strip()
            continue
        if in_block:
            body.append(line)
        else:
            prose.append((n, line))
    return prose, blocks


def strip_inline_code(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces → -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps Unicode letters, digits and _
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_fenced(text)
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        if slug in seen:
            seen[slug] += 1
            out.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            out.add(slug)
    # explicit HTML anchors
    out.update(re.findall(r'<a\s+(?:name|id)="([^"]+)"', text))
    return out


LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


# ---------------------------------------------------------------------------------------------
# Check: configuration fields


def schema_field_paths(schema: dict) -> set[str]:
    """Every field path of the schema, dotted, arrays as `[]` (e.g. `endpoints[].address`)."""
    defs = schema.get("$defs", {})
    paths: set[str] = set()

    def resolve(node: dict) -> list[dict]:
        out = []
        if "$ref" in node:
            out += resolve(defs[node["$ref"].split("/")[-1]])
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in node.get(key, []):
                out += resolve(sub)
        if "properties" in node or "items" in node or "additionalProperties" in node:
            out.append(node)
        return out

    def walk(node: dict, prefix: str, depth: int) -> None:
        if depth > 12:
            return
        for n in resolve(node):
            for name, sub in n.get("properties", {}).items():
                path = f"{prefix}.{name}" if prefix else name
                paths.add(path)
                walk(sub, path, depth + 1)
            if isinstance(n.get("items"), dict):
                walk(n["items"], prefix + "[]", depth + 1)
            if isinstance(n.get("additionalProperties"), dict):
                walk(n["additionalProperties"], prefix + ".*", depth + 1)

    walk(schema, "", 0)
    return paths


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading chain joined by ' ', body) for every heading of a Markdown document."""
    out, chain, body = [], [], []
    heading = ""
    prose, _ = split_fenced(text)
    for _, line in prose:
        m = re.match(r"^(#{1,6})\s+(.*)$", line)
        if m:
            out.append((heading, "\n".join(body)))
            level = len(m.group(1))
            chain = chain[: level - 1] + [m.group(2)]
            heading, body = " ".join(chain), []
        else:
            body.append(line)
    out.append((heading, "\n".join(body)))
    return out


def missing_config_fields(fields: set[str], reference: str) -> list[str]:
    """Fields the reference does not document. A field counts as documented when its full path
    appears (with or without `[]`), or when its name appears in backticks in a section whose
    heading names its parent path."""
    flat = reference.replace("[]", "").replace(".*", "")
    sections = [(h.replace("`", "").replace("[]", ""), b) for h, b in _sections(reference)]
    missing = []
    for path in sorted(fields):
        plain = path.replace("[]", "").replace(".*", "")
        if re.search(rf"(?<![\w.]){re.escape(plain)}(?![\w])", flat):
            continue
        if ".*" in path:  # a map's values: any key spelling (`*`, `<model>`, `{name}`, `NAME`)
            key = r"(?:\*|<[^>\s]+>|\{[^}\s]+\}|[\w-]+)"
            rx = r"\.".join(key if part == "*" else re.escape(part)
                             for part in path.replace("[]", "").split("."))
            if re.search(rf"(?<![\w.]){rx}(?![\w])", reference):
                continue
        parent, _, leaf = plain.rpartition(".")
        found = False
        if parent:
            for heading, body in sections:
                if re.search(rf"(?<![\w.]){re.escape(parent)}(?![\w.])", heading) and \
                        re.search(rf"`{re.escape(leaf)}`", body):
                    found = True
                    break
        if not found:
            missing.append(path)
    return missing


# ---------------------------------------------------------------------------------------------
# Check: metrics

# String literals in src/ that start with the metric prefix but are not metrics.
NOT_METRICS = {
    "inference_picker_pool": "filter state: the pool that claimed a request (request/pools.rs)",
    "inference_picker_parsed": "filter state: the parsed body handed to the next pool",
    "inference_picker_prompt_tokens": "filter state: a response's prompt tokens (request/usage.rs)",
    "inference_picker_completion_tokens": "filter state: a response's completion tokens",
    **{f"inference_picker_{k}": "filter state: the decision record (request/decision.rs)" for k in (
        "endpoint", "fallbacks", "prefill_endpoint", "reason", "model", "priority", "objective", "tier",
        "predicted_ttft_ms", "ttft_target_ms", "slo", "queue_ms", "error")},
    "inference_picker_reject": "local reply details (Envoy's response_code_details)",
    "inference_picker_local": "local reply details",
}
HISTOGRAMS = {"inference_picker_flow_queue_time_ms", "inference_picker_ttft_ms",
              "inference_picker_ttft_prediction_ratio_pct"}


def emitted_metrics(src: Path) -> set[str]:
    """Every metric name in the module's source: the consts of base/telemetry.rs, and any other
    string literal with the prefix that is not known to be something else."""
    names = set()
    for f in src.rglob("*.rs"):
        code = "\n".join(l for l in f.read_text().splitlines() if not l.lstrip().startswith("//"))
        names.update(re.findall(r'"(inference_picker_[a-z0-9_]+)', code))
    return names - set(NOT_METRICS)


def missing_metrics(metrics: set[str], reference: str) -> list[str]:
    return sorted(m for m in metrics if not re.search(rf"`{re.escape(m)}`", reference))


# ---------------------------------------------------------------------------------------------
# Check: Makefile targets


def makefile_targets(makefile: str) -> set[str]:
    targets = set()
    for line in makefile.splitlines():
        m = re.match(r"^([A-Za-z0-9_.][A-Za-z0-9_. -]*?)\s*::?(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets - {".PHONY"}


def make_targets_named(text: str) -> set[str]:
    """Targets of `make X` in inline code and code blocks (prose 'make' is a verb)."""
    prose, blocks = split_fenced(text)
    code = [c for _, line in prose for c in re.findall(r"`([^`]*)`", line)]
    code += [b for _, b in blocks]
    found = set()
    for c in code:
        for m in re.finditer(r"(?:^|[\s;&|(])make((?:\s+[A-Z_]+=\S+)*)\s+([a-z][a-z0-9_-]*)", c, re.M):
            found.add(m.group(2))
    return found


def missing_make_targets(docs: dict[str, str], targets: set[str]) -> list[str]:
    return sorted(f"{name}: make {t}" for name, text in docs.items()
                  for t in make_targets_named(text) if t not in targets)


# ---------------------------------------------------------------------------------------------
# Check: links and anchors


def broken_links(doc: Path, text: str, root: Path, pending: set[Path] = frozenset()) -> list[str]:
    problems = []
    prose, _ = split_fenced(text)
    for n, line in prose:
        for m in LINK.finditer(strip_inline_code(line) if "`[" not in line else line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            if not path_part:
                if anchor not in anchors(text):
                    problems.append(f"{doc.relative_to(root)}:{n}: {target}: no heading with that anchor")
                continue
            dest = (doc.parent / path_part).resolve()
            if dest in pending and not dest.exists():
                continue  # reported by its own check
            if not dest.exists():
                problems.append(f"{doc.relative_to(root)}:{n}: {target}: no such file")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md":
                if anchor not in anchors(dest.read_text()):
                    problems.append(f"{doc.relative_to(root)}:{n}: {target}: no heading with that anchor")
    return problems


# ---------------------------------------------------------------------------------------------
# Check: repository paths in backticks

PATH_ROOTS = ("src/", "tools/", "tests/", "envoy/", "filter-config/", "docs/", "deploy/", "benches/", "fuzz/")


def missing_paths(doc_name: str, text: str, root: Path) -> list[str]:
    """Paths resolve from the repository root, or from the document's own directory (a tool's
    README names its crate's `src/...`)."""
    here = (root / doc_name).parent
    problems = []
    prose, _ = split_fenced(text)
    for n, line in prose:
        for code in re.findall(r"`([^`\s]+)`", line):
            p = code.rstrip("/.,:")
            if not p.startswith(PATH_ROOTS) or any(ch in p for ch in "<>*{}$|"):
                continue
            p = p.split(":")[0].split("#")[0]
            if not (root / p).exists() and not (here / p).exists():
                problems.append(f"{doc_name}:{n}: `{code}` does not exist")
    return problems


# ---------------------------------------------------------------------------------------------
# Check: configurations shown in the docs


def unshipped_configs(doc_name: str, text: str, examples: list[object]) -> list[str]:
    problems = []
    _, blocks = split_fenced(text)
    for info, body in blocks:
        if info != "json" or '"version"' not in body:
            continue
        try:
            doc = json.loads(body)
        except json.JSONDecodeError as e:
            problems.append(f"{doc_name}: a json block does not parse: {e}")
            continue
        if doc not in examples:
            problems.append(f"{doc_name}: a configuration is not one of filter-config/examples/")
    return problems


# ---------------------------------------------------------------------------------------------
# Check: history and internal references in user docs

FORBIDDEN = [
    (re.compile(r"(?:^|[\s(\[])#\d+\b"), "an issue number"),
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"\bthis session\b", re.I), "'this session'"),
    (re.compile(r"\b(?:first|second|third|fourth|fifth|previous|last) session\b", re.I), "a session"),
    (re.compile(r"\bthis branch\b", re.I), "'this branch'"),
    (re.compile(r"\bmerged main\b", re.I), "'merged main'"),
]
HEX = re.compile(r"(?<![\w./:#=@-])([0-9a-f]{7,40})(?![\w/-])")


def history_problems(doc_name: str, text: str) -> list[str]:
    problems = []
    prose, _ = split_fenced(text)
    for n, line in prose:
        no_urls = re.sub(r"https?://\S+", "", line)
        for rx, what in FORBIDDEN:
            if rx.search(no_urls):
                problems.append(f"{doc_name}:{n}: {what}: {line.strip()[:100]}")
        for m in HEX.finditer(no_urls):
            word = m.group(1)
            if re.search(r"[a-f]", word) and re.search(r"\d", word):
                problems.append(f"{doc_name}:{n}: a commit hash ({word}): {line.strip()[:100]}")
    return problems


# ---------------------------------------------------------------------------------------------
# Check: the Grafana dashboard

PROMQL_WORDS = {
    # functions
    "sum", "rate", "irate", "increase", "avg", "max", "min", "count", "topk", "bottomk",
    "histogram_quantile", "clamp_min", "clamp_max", "label_replace", "delta", "deriv", "abs",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "vector", "scalar",
    "time", "absent", "changes", "resets", "round", "ceil", "floor", "sort", "sort_desc",
    # keywords
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset",
}
# Envoy's own series the dashboard may use besides the module's.
ENVOY_METRICS = {
    "envoy_http_downstream_rq_xx",
    "envoy_cluster_upstream_rq_xx",
    "envoy_cluster_upstream_rq_retry",
}
# The model servers' own series (vLLM), for what the module reads but does not re-export: the
# dashboard graphs them from Prometheus's scrape of the pods.
MODEL_SERVER_METRICS = {
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
}


def expr_metrics(expr: str) -> set[str]:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)       # strings
    e = re.sub(r"\{[^}]*\}", "", e)                   # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", e)
    e = re.sub(r"\$\w+|\$\{[^}]*\}", "", e)           # dashboard variables
    tokens = set(re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)", e))
    return {t for t in tokens if t not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhdwy]", t)}


def dashboard_problems(text: str, emitted: set[str]) -> list[str]:
    try:
        dash = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"dashboard: not JSON: {e}"]
    problems = []
    if not isinstance(dash.get("schemaVersion"), int):
        problems.append("dashboard: no integer schemaVersion")
    panels = dash.get("panels")
    if not isinstance(panels, list) or not panels:
        return problems + ["dashboard: no panels"]
    allowed = set(emitted) | ENVOY_METRICS | MODEL_SERVER_METRICS
    allowed |= {h + s for h in HISTOGRAMS & emitted for s in ("_bucket", "_sum", "_count")}
    exprs = 0
    for p in panels:
        if p.get("type") == "row":
            continue
        targets = p.get("targets")
        if not targets:
            problems.append(f"dashboard: panel {p.get('title')!r} has no targets")
            continue
        for t in targets:
            expr = t.get("expr")
            if not expr:
                problems.append(f"dashboard: panel {p.get('title')!r} has a target without expr")
                continue
            exprs += 1
            for name in expr_metrics(expr):
                if name not in allowed:
                    problems.append(f"dashboard: panel {p.get('title')!r}: {name} is not exported")
    if not exprs:
        problems.append("dashboard: no expr at all")
    return problems


# ---------------------------------------------------------------------------------------------
# The checks on the repository


def _docs() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in user_docs()}


def test_configuration_reference_lists_every_field():
    assert CONFIG_REFERENCE.is_file(), (
        "docs/configuration.md (the per-field configuration reference, generated from the one "
        "declaration of each setting) is missing: it is what documents every field of "
        "filter-config/schema.json")
    fields = schema_field_paths(json.loads((ROOT / "filter-config" / "schema.json").read_text()))
    assert len(fields) > 50, fields
    missing = missing_config_fields(fields, CONFIG_REFERENCE.read_text())
    assert not missing, f"fields missing from docs/configuration.md: {missing}"


def test_metrics_reference_lists_every_metric():
    metrics = emitted_metrics(ROOT / "src")
    assert len(metrics) >= 20, metrics
    missing = missing_metrics(metrics, METRICS_REFERENCE.read_text())
    assert not missing, f"metrics missing from docs/observability.md: {missing}"


def test_make_targets_named_in_the_docs_exist():
    targets = makefile_targets((ROOT / "Makefile").read_text())
    assert {"run", "test", "bench-routing", "bench-envoy"} <= targets
    assert not missing_make_targets(_docs(), targets)


def test_links_and_anchors_resolve():
    problems = []
    for p in user_docs():
        problems += broken_links(p, p.read_text(), ROOT, pending={CONFIG_REFERENCE})
    assert not problems, "\n".join(problems)


def test_paths_named_in_the_docs_exist():
    problems = []
    for name, text in _docs().items():
        problems += missing_paths(name, text, ROOT)
    assert not problems, "\n".join(problems)


def test_configurations_in_the_docs_are_shipped_examples():
    examples = [json.loads(p.read_text()) for p in sorted((ROOT / "filter-config" / "examples").glob("*.json"))]
    problems = []
    for name, text in _docs().items():
        problems += unshipped_configs(name, text, examples)
    assert not problems, "\n".join(problems)


def test_user_docs_carry_no_history():
    problems = []
    for name, text in _docs().items():
        problems += history_problems(name, text)
    assert not problems, "\n".join(problems)


def test_dashboard_queries_only_exported_metrics():
    problems = dashboard_problems(DASHBOARD.read_text(), emitted_metrics(ROOT / "src"))
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for guide in ("docs/deploy-envoy.md", "docs/deploy-compose.md", "docs/istio.md"):
        assert f"]({guide})" in readme, f"README does not link {guide}"


# ---------------------------------------------------------------------------------------------
# Self-checks: each checker catches a planted bad document.


def test_self_check_config_fields(tmp_path):
    schema = {"type": "object", "properties": {
        "poller": {"$ref": "#/$defs/P"},
        "endpoints": {"type": "array", "items": {"$ref": "#/$defs/E"}}},
        "$defs": {"P": {"type": "object", "properties": {"interval_ms": {}, "timeout_ms": {}}},
                  "E": {"type": "object", "properties": {"address": {}}}}}
    fields = schema_field_paths(schema)
    assert fields == {"poller", "poller.interval_ms", "poller.timeout_ms", "endpoints", "endpoints[].address"}
    good = "`poller`, `endpoints`\n## poller\n| `interval_ms` | ... |\n`poller.timeout_ms`\n`endpoints[].address`"
    assert missing_config_fields(fields, good) == []
    bad = "`poller`, `endpoints`\n## poller\n| `interval_ms` | ... |\n`endpoints[].address`"
    assert missing_config_fields(fields, bad) == ["poller.timeout_ms"]
    mapped = {"weights", "weights.*", "weights.*.queue"}
    assert missing_config_fields(mapped, "`weights`, `weights.<model>`, `weights.<model>.queue`") == []
    assert missing_config_fields(mapped, "`weights`, `weights.<model>`") == ["weights.*.queue"]
    # A leaf named under another section does not count.
    assert "poller.interval_ms" in missing_config_fields(fields, "## filter\n`interval_ms`")


def test_self_check_metrics(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "t.rs").write_text('pub const A: &str = "inference_picker_a_total";\n'
                              '// "inference_picker_comment_only"\n'
                              'const P: &str = "inference_picker_pool";\n'
                              'fn f() { m("inference_picker_b_ms;x=1") }\n')
    assert emitted_metrics(src) == {"inference_picker_a_total", "inference_picker_b_ms"}
    assert missing_metrics({"inference_picker_a_total", "inference_picker_b_ms"},
                           "| `inference_picker_a_total` | |") == ["inference_picker_b_ms"]


def test_self_check_make_targets():
    targets = makefile_targets("all: wasm\nrun: wasm sim\n\tcmd\nX := 1\nbench-envoy: wasm\n")
    assert targets == {"all", "run", "bench-envoy"}
    doc = "Run `make run`, or:\n```sh\nmake FOO=1 bench-envoy && make nosuch\n```\nWe make sure."
    assert missing_make_targets({"d.md": doc}, targets) == ["d.md: make nosuch"]


def test_self_check_links(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n## Deploy on `Envoy`, step 2\n## Deploy on `Envoy`, step 2\n")
    doc = tmp_path / "b.md"
    text = ("[ok](a.md#deploy-on-envoy-step-2) [dup](a.md#deploy-on-envoy-step-2-1) [self](#here)\n"
            "## Here\n[gone](missing.md) [bad anchor](a.md#nope) [web](https://example.com/x#y)\n"
            "```\n[in code](nowhere.md)\n```\n")
    problems = broken_links(doc, text, tmp_path)
    assert len(problems) == 2 and "missing.md" in problems[0] and "#nope" in problems[1], problems
    assert github_slug("Cost inside Envoy: `make bench-envoy`") == "cost-inside-envoy-make-bench-envoy"


def test_self_check_paths(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "lib.rs").write_text("")
    text = "See `src/lib.rs` and `src/lib.rs:12`, not `src/gone.rs`; `src/<wing>/` is a pattern."
    problems = missing_paths("d.md", text, tmp_path)
    assert len(problems) == 1 and "src/gone.rs" in problems[0], problems


def test_self_check_configs():
    examples = [{"version": 1, "models": []}]
    good = '```json\n{"version": 1, "models": []}\n```\n'
    bad = '```json\n{"version": 1, "models": [], "typo": 1}\n```\n```json\n{"version": 1,\n```\n'
    assert unshipped_configs("d.md", good, examples) == []
    assert len(unshipped_configs("d.md", bad, examples)) == 2


@pytest.mark.parametrize("line", [
    "Fixed in #12.", "As issue 12 asked.", "Issue #12, second pass", "measured this session",
    "on this branch", "the code of merged main", "the second session's run",
    "the replay code of commit a07a067 (unchanged since)", "old (155b512) and new binaries",
])
def test_self_check_history_catches(line):
    assert history_problems("d.md", line + "\n"), line


@pytest.mark.parametrize("line", [
    "See [GIE](https://github.com/kubernetes-sigs/gateway-api-inference-extension/issues/2928).",
    "llm-d-router#1109 measured it.", "as `owner/repo@84436a96` ships it", "a sha256 digest sha256:0a1b2c3d4e5f60718293a4b5c6d7e8f9",
    "1,119,553 bytes", "the value 0x9e3779b97f4a7c15", "## Step 3: pod discovery",
    "```\ngit log 1234abcd\n```", "a 1024-endpoint pool", "fnv1a32 and deadbeef",
])
def test_self_check_history_allows(line):
    assert not history_problems("d.md", line + "\n"), line


def test_self_check_dashboard():
    emitted = {"inference_picker_requests_total", "inference_picker_flow_queue_time_ms"}
    good = json.dumps({"schemaVersion": 39, "panels": [
        {"type": "row", "title": "r"},
        {"title": "ok", "targets": [{"expr": 'sum by (outcome) (rate(inference_picker_requests_total{pool=~"$pool"}[5m]))'},
                                    {"expr": "histogram_quantile(0.9, sum by (le) (rate(inference_picker_flow_queue_time_ms_bucket[5m])))"}]}]})
    assert dashboard_problems(good, emitted) == []
    bad = json.dumps({"schemaVersion": 39, "panels": [
        {"title": "typo", "targets": [{"expr": "rate(inference_picker_request_total[5m])"}]},
        {"title": "empty", "targets": []}]})
    problems = dashboard_problems(bad, emitted)
    assert len(problems) == 2 and "inference_picker_request_total" in problems[0], problems
    assert dashboard_problems("{not json", emitted)[0].startswith("dashboard: not JSON")
    assert "no integer schemaVersion" in dashboard_problems(json.dumps({"panels": [
        {"title": "ok", "targets": [{"expr": "inference_picker_requests_total"}]}]}), emitted)[0]


def decision_keys() -> list[str]:
    """The filter-state keys of the decision record, from its consts in request/decision.rs."""
    code = (ROOT / "src" / "request" / "decision.rs").read_text()
    return re.findall(r'pub const [A-Z_]+: &str = "(inference_picker_[a-z_]+)";', code)


def test_decision_record_is_documented_logged_and_traced():
    keys = decision_keys()
    assert len(keys) >= 10, keys
    # Every key is one the metrics check knows is filter state, not a metric.
    assert set(keys) <= set(NOT_METRICS), sorted(set(keys) - set(NOT_METRICS))
    reference = METRICS_REFERENCE.read_text()
    envoy_yaml = (ROOT / "envoy" / "envoy.yaml").read_text()
    hcm = yaml.safe_load(envoy_yaml)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    log_format = json.dumps(hcm["access_log"][0]["typed_config"]["log_format"])
    tags = json.dumps(hcm["tracing"]["custom_tags"])
    for key in keys + ["inference_picker_prompt_tokens", "inference_picker_completion_tokens"]:
        state = f"%FILTER_STATE(wasm.{key}:PLAIN)%"
        assert f"`wasm.{key}`" in reference, f"{key} is not in docs/observability.md"
        assert state in log_format, f"{key} is not in envoy/envoy.yaml's access log"
        assert state in tags, f"{key} is not a tracing custom tag in envoy/envoy.yaml"


def test_token_budget_page_shows_the_tested_example_whole():
    """docs/token-budget.md shows envoy/examples/token-budget.yaml as it is (the file
    tests/e2e/test_token_budget.py runs), and the example charges the keys the module sets."""
    example = (ROOT / "envoy" / "examples" / "token-budget.yaml").read_text()
    page = (ROOT / "docs" / "token-budget.md").read_text()
    assert f"```yaml\n{example}```\n" in page, "docs/token-budget.md does not show the example as it is"
    usage = (ROOT / "src" / "request" / "usage.rs").read_text()
    keys = re.findall(r'pub const [A-Z_]+_PROPERTY: &str = "(inference_picker_[a-z_]+)";', usage)
    assert sorted(keys) == ["inference_picker_completion_tokens", "inference_picker_prompt_tokens"], keys
    doc = yaml.safe_load(example)
    limits = doc["route_typed_per_filter_config"]["envoy.filters.http.ratelimit"]["rate_limits"]
    charged = [rl["hits_addend"]["format"] for rl in limits if rl.get("apply_on_stream_done")]
    assert charged == [f"%FILTER_STATE(wasm.{k}:PLAIN)%" for k in sorted(keys, reverse=True)], charged


def label_values(code: str, enum: str) -> list[str]:
    """The strings an enum's `as_str` gives (`Enum::Variant => "value"` arms)."""
    return re.findall(rf'\b{enum}::\w+ => "([a-z_]+)"', code)


def row_problems(reference: str, row_start: str, values: list[str], what: str) -> list[str]:
    """Every value is named (in backticks) in the reference table's row that starts with `row_start`."""
    rows = [l for l in reference.splitlines() if l.startswith(row_start)]
    if len(rows) != 1:
        return [f"{what}: {len(rows)} rows start with {row_start!r}"]
    return [f"{what}: `{v}` is not in the row {row_start!r}" for v in values if f"`{v}`" not in rows[0]]


def test_decision_reasons_and_pick_outcomes_are_documented():
    reference = METRICS_REFERENCE.read_text()
    reasons = label_values((ROOT / "src" / "request" / "decision.rs").read_text(), "Reason")
    outcomes = label_values((ROOT / "src" / "scheduler" / "mod.rs").read_text(), "PickReason")
    assert "count_tokens" in reasons and "load" in reasons, reasons
    assert "count_tokens" in outcomes and "scored" in outcomes, outcomes
    problems = row_problems(reference, "| `wasm.inference_picker_reason`", reasons, "decision reason")
    problems += row_problems(reference, "| `inference_picker_requests_total`", outcomes, "requests outcome")
    assert problems == [], problems


def test_self_check_reasons():
    doc = "| `wasm.inference_picker_reason` | x | `load` |\n| other | `prefix_hit` |\n"
    assert row_problems(doc, "| `wasm.inference_picker_reason`", ["load"], "r") == []
    assert row_problems(doc, "| `wasm.inference_picker_reason`", ["load", "prefix_hit"], "r") == [
        "r: `prefix_hit` is not in the row '| `wasm.inference_picker_reason`'"]
    assert row_problems(doc, "| `missing`", ["load"], "r")[0].startswith("r: 0 rows")
    assert label_values('Reason::Load => "load",\n PickReason::Scored => "scored"', "Reason") == ["load"]

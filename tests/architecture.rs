//! The architecture, checked (docs/architecture.md draws it):
//! - each wing of `src/` imports only from wings below it, in the order of [`WINGS`];
//! - no import circle between files, in `src/` or in any crate under `tools/`;
//! - nothing outside `src/host/` names the proxy-wasm SDK;
//! - no file of `src/` over [`MAX_FILE_LINES`] lines (test modules in their own files aside), no
//!   function of `src/` over [`MAX_FN_LINES`] lines (tests included).
//!
//! Imports are read from the code: `crate::…` paths (in `use` trees too) and `super::`/`self::`
//! paths, with comments, string literals and `#[cfg(test)]` items left out (tests may reach
//! anywhere). A path names the deepest module file it reaches.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The wings of `src/`, lowest first. `fuzzing` (native builds only) and `host` sit on top.
const WINGS: [&str; 10] =
    ["base", "state", "scheduler", "flow", "request", "poll", "config", "fuzzing", "host", "lib"];

/// A module path (`["scheduler", "prefix"]`) and the source of its file.
struct Module {
    path: Vec<String>,
    file: PathBuf,
    code: String,
}

/// The source with comments, string and char literals blanked (a literal becomes `""`, a comment
/// a space; the line breaks inside them are kept, so every line stays on its line).
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !b.get(i.wrapping_sub(1)).is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            let mut lines = 0;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                lines += usize::from(b[j] == '\n');
                j += 1;
            }
            out.push_str("\"\"");
            out.extend(std::iter::repeat_n('\n', lines));
            i = j;
        } else if c == '"' {
            i += 1;
            let mut lines = 0;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                lines += usize::from(b.get(i) == Some(&'\n'));
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
            out.extend(std::iter::repeat_n('\n', lines));
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), not a lifetime.
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The index just past the `}` that closes the `{` at `open`.
fn block_end(s: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, &ch) in s.iter().enumerate().skip(open) {
        match ch {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    s.len()
}

/// `code` without its `#[cfg(test)]` items; and the names of the test modules it declares as
/// files (`#[cfg(test)] mod tests;`).
fn without_tests(code: &str) -> (String, Vec<String>) {
    let mut out = code.to_string();
    let mut test_files = Vec::new();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at + "#[cfg(test)]".len()..];
        let item_start = at + "#[cfg(test)]".len() + (rest.len() - rest.trim_start().len());
        let bytes = out.as_bytes();
        let semi = out[item_start..].find(';').map(|k| item_start + k);
        let brace = out[item_start..].find('{').map(|k| item_start + k);
        let end = match (semi, brace) {
            (Some(s), b) if b.is_none_or(|b| s < b) => {
                let item = out[item_start..s].trim();
                if let Some(name) = item.strip_prefix("mod ").or_else(|| item.strip_prefix("pub mod ")) {
                    test_files.push(name.trim().to_string());
                }
                s + 1
            }
            (_, Some(b)) => block_end(bytes, b),
            _ => out.len(),
        };
        out.replace_range(at..end, "");
    }
    (out, test_files)
}

/// Every module file under `root` (a crate's `src/`), by module path; files that are test
/// modules of their parent are left out.
fn modules(root: &Path) -> Vec<Module> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(root, &mut files);
    let mut all = Vec::new();
    let mut test_files: BTreeSet<PathBuf> = BTreeSet::new();
    for f in files {
        let rel = f.strip_prefix(root).unwrap().with_extension("");
        let mut path: Vec<String> = rel.iter().map(|c| c.to_string_lossy().to_string()).collect();
        let is_dir_module = matches!(path.last().map(String::as_str), Some("mod" | "lib" | "main"));
        if is_dir_module {
            path.pop();
        }
        let (code, tests) = without_tests(&strip(&std::fs::read_to_string(&f).unwrap()));
        let dir = if is_dir_module { f.parent().unwrap().to_path_buf() } else { f.with_extension("") };
        for t in tests {
            test_files.insert(dir.join(format!("{t}.rs")));
            test_files.insert(dir.join(&t).join("mod.rs"));
        }
        all.push(Module { path, file: f, code });
    }
    all.retain(|m| !test_files.contains(&m.file));
    all
}

/// The module paths `code` refers to, absolute from the crate root. `here` is the module's own
/// path: `self` is `here`, `super` its parent (for `a/b.rs` and `a/b/mod.rs` alike).
fn references(code: &str, here: &[String], crate_names: &[&str]) -> Vec<Vec<String>> {
    let toks = tokens(code);
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        let is_root = t == "crate" || crate_names.contains(&t);
        if (is_root || t == "super" || t == "self") && toks.get(i + 1).map(String::as_str) == Some("::") {
            // `self::x` in a file module is its own child; `super` climbs from the file's module.
            let mut base: Vec<String> = if is_root { Vec::new() } else { here.to_vec() };
            let mut j = i;
            while toks.get(j).map(String::as_str) == Some("super")
                && toks.get(j + 1).map(String::as_str) == Some("::")
            {
                base.pop();
                j += 2;
            }
            if toks.get(j).map(String::as_str) == Some("self") || is_root {
                j += 2;
            }
            let (paths, next) = path_tree(&toks, j, base);
            out.extend(paths);
            i = next.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Reads a path or a `use` tree (`a::b`, `a::{b, c::{d, e}}`) from `toks[i..]`, prefixed by
/// `base`; returns the full paths and where it stopped.
fn path_tree(toks: &[String], mut i: usize, mut base: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let mut out = Vec::new();
    loop {
        match toks.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                loop {
                    let (p, next) = path_tree(toks, i, base.clone());
                    out.extend(p);
                    i = next;
                    match toks.get(i).map(String::as_str) {
                        Some(",") => i += 1,
                        Some("}") => {
                            i += 1;
                            break;
                        }
                        _ => break,
                    }
                    if toks.get(i).map(String::as_str) == Some("}") {
                        i += 1;
                        break;
                    }
                }
                return (out, i);
            }
            Some(t) if is_ident(t) => {
                if t != "self" {
                    base.push(t.to_string());
                }
                i += 1;
                if toks.get(i).map(String::as_str) == Some("::") {
                    i += 1;
                    continue;
                }
                out.push(base);
                return (out, i);
            }
            _ => {
                out.push(base);
                return (out, i);
            }
        }
    }
}

fn is_ident(t: &str) -> bool {
    t.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
        && t.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// Identifiers, `::`, and single punctuation characters.
fn tokens(code: &str) -> Vec<String> {
    let b: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(b[start..i].iter().collect());
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// File-to-file import arrows of the crate at `root`: module path → the module paths it uses.
fn arrows(root: &Path, crate_names: &[&str]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mods = modules(root);
    let known: BTreeSet<Vec<String>> = mods.iter().map(|m| m.path.clone()).collect();
    let mut out = BTreeMap::new();
    for m in &mods {
        let mut targets = BTreeSet::new();
        for r in references(&m.code, &m.path, crate_names) {
            if let Some(n) = (1..=r.len()).rev().find(|&n| known.contains(&r[..n])) {
                let t = r[..n].to_vec();
                if t != m.path {
                    targets.insert(t);
                }
            }
        }
        out.insert(m.path.clone(), targets);
    }
    out
}

/// The import circles (strongly connected groups of two or more files).
fn circles(arrows: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    // Kosaraju: order by finish time, then walk the reversed graph.
    let nodes: Vec<&Vec<String>> = arrows.keys().collect();
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    fn visit<'a>(
        n: &'a Vec<String>,
        g: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        seen: &mut BTreeSet<&'a Vec<String>>,
        order: &mut Vec<&'a Vec<String>>,
    ) {
        if !seen.insert(n) {
            return;
        }
        for m in g.get(n).into_iter().flatten() {
            if let Some((k, _)) = g.get_key_value(m) {
                visit(k, g, seen, order);
            }
        }
        order.push(n);
    }
    for n in &nodes {
        visit(n, arrows, &mut seen, &mut order);
    }
    let mut rev: BTreeMap<&Vec<String>, Vec<&Vec<String>>> = BTreeMap::new();
    for (a, bs) in arrows {
        for b in bs {
            if let Some((k, _)) = arrows.get_key_value(b) {
                rev.entry(k).or_default().push(a);
            }
        }
    }
    let mut assigned = BTreeSet::new();
    let mut out = Vec::new();
    for n in order.into_iter().rev() {
        if assigned.contains(n) {
            continue;
        }
        let mut group = Vec::new();
        let mut stack = vec![n];
        assigned.insert(n);
        while let Some(x) = stack.pop() {
            group.push(x.join("::"));
            for y in rev.get(x).into_iter().flatten() {
                if assigned.insert(*y) {
                    stack.push(y);
                }
            }
        }
        if group.len() > 1 {
            group.sort();
            out.push(group);
        }
    }
    out
}

fn rank(wing: &str) -> Option<usize> {
    WINGS.iter().position(|w| *w == wing)
}

fn wing_of(path: &[String]) -> &str {
    path.first().map_or("lib", String::as_str)
}

/// Imports that run up: `(file, wing it may not use)`.
fn upward(arrows: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<String> {
    let mut out = Vec::new();
    for (from, tos) in arrows {
        let w = wing_of(from);
        for to in tos {
            let v = wing_of(to);
            match (rank(w), rank(v)) {
                (Some(a), Some(b)) if b > a => {
                    out.push(format!("{} imports {} (wing {v} is above {w})", from.join("::"), to.join("::")))
                }
                (None, _) | (_, None) => out.push(format!(
                    "{} or {} is in no wing (add it to WINGS and docs/architecture.md)",
                    from.join("::"),
                    to.join("::")
                )),
                _ => {}
            }
        }
    }
    out
}

/// Longest a non-test file of `src/` may be, in lines.
const MAX_FILE_LINES: usize = 1_000;
/// Longest a function in `src/` may be, in lines (from its `fn` line to its closing brace).
const MAX_FN_LINES: usize = 150;

/// Every function with a body in `code` (already [`strip`]ped, so braces in comments and
/// literals do not count): `(first line, name, lines)`, the lines counted from the `fn` line to
/// the line of its closing brace. A nested function is listed too (and counts in its parent).
fn functions(code: &str) -> Vec<(usize, String, usize)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = code[from..].find("fn ") {
        let at = from + k;
        from = at + 3;
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let name: String =
            code[at + 3..].trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            continue;
        }
        // The body's `{`: the first one outside parentheses and brackets, unless a `;` ends the
        // declaration first (a trait method without a body).
        let mut depth = 0i32;
        let mut open = None;
        for (j, &ch) in b.iter().enumerate().skip(at) {
            match ch {
                b'(' | b'[' => depth += 1,
                b')' | b']' => depth -= 1,
                b';' if depth == 0 => break,
                b'{' if depth == 0 => {
                    open = Some(j);
                    break;
                }
                _ => {}
            }
        }
        let Some(open) = open else { continue };
        let end = block_end(b, open);
        let first = code[..at].matches('\n').count() + 1;
        out.push((first, name, code[at..end].matches('\n').count() + 1));
    }
    out
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// Files of `src/` over [`MAX_FILE_LINES`] (test modules in their own files aside), and functions
/// over [`MAX_FN_LINES`] in any file of `root` (tests included), as `path:line name: n lines`.
fn oversized(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for m in modules(root) {
        let n = std::fs::read_to_string(&m.file).unwrap().lines().count();
        if n > MAX_FILE_LINES {
            found.push(format!("{}: {n} lines (at most {MAX_FILE_LINES})", m.file.display()));
        }
    }
    for f in rust_files(root) {
        for (line, name, n) in functions(&strip(&std::fs::read_to_string(&f).unwrap())) {
            if n > MAX_FN_LINES {
                found.push(format!("{}:{line} fn {name}: {n} lines (at most {MAX_FN_LINES})", f.display()));
            }
        }
    }
    found
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn wings_import_only_from_wings_below() {
    let a = arrows(&repo().join("src"), &[]);
    assert!(a.len() > 40, "too few modules found: {}", a.len());
    assert!(a.values().map(BTreeSet::len).sum::<usize>() > 100, "too few imports read");
    let up = upward(&a);
    assert!(up.is_empty(), "imports that run up:\n{}", up.join("\n"));
}

#[test]
fn no_import_circle_in_src_or_tools() {
    let mut found = Vec::new();
    let mut roots = vec![("src".to_string(), repo().join("src"), "inference_picker".to_string())];
    for e in std::fs::read_dir(repo().join("tools")).unwrap() {
        let p = e.unwrap().path();
        if p.join("src").is_dir() {
            let name = p.file_name().unwrap().to_string_lossy().replace('-', "_");
            roots.push((format!("tools/{}", p.file_name().unwrap().to_string_lossy()), p.join("src"), name));
        }
    }
    assert!(roots.len() > 3, "the tools were not found");
    for (label, root, name) in &roots {
        // A tool's binary (main.rs) may use its own library by the crate's name.
        for c in circles(&arrows(root, &[name.as_str()])) {
            found.push(format!("{label}: {}", c.join(" <-> ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn only_host_calls_the_proxy_wasm_sdk() {
    let mut found = Vec::new();
    for m in modules(&repo().join("src")) {
        if wing_of(&m.path) != "host" && tokens(&m.code).iter().any(|t| t == "proxy_wasm") {
            found.push(m.file.display().to_string());
        }
    }
    assert!(found.is_empty(), "proxy-wasm SDK named outside src/host/: {found:?}");
}

#[test]
fn no_src_file_over_1000_lines_no_function_over_150() {
    let root = repo().join("src");
    assert!(
        rust_files(&root)
            .iter()
            .map(|f| functions(&strip(&std::fs::read_to_string(f).unwrap())).len())
            .sum::<usize>()
            > 500,
        "too few functions found"
    );
    // `ARCH_SIZES=<n>` prints the n longest functions (the measurement behind the limit).
    if let Some(n) = std::env::var("ARCH_SIZES").ok().and_then(|v| v.parse::<usize>().ok()) {
        let mut all: Vec<(usize, String)> = Vec::new();
        for dir in ["src", "tools", "benches", "tests"] {
            for f in rust_files(&repo().join(dir)) {
                if f.components().any(|c| c.as_os_str() == "target") {
                    continue;
                }
                for (line, name, len) in functions(&strip(&std::fs::read_to_string(&f).unwrap())) {
                    all.push((len, format!("{}:{line} {name}", f.strip_prefix(repo()).unwrap().display())));
                }
            }
        }
        all.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        for (len, what) in all.iter().take(n) {
            println!("{len:5} {what}");
        }
    }
    let found = oversized(&root);
    assert!(found.is_empty(), "too long:\n{}", found.join("\n"));
}

/// The checks catch what they are for: a planted upward import, a planted circle and a planted
/// SDK call, in a throwaway tree.
#[test]
fn the_checks_fail_on_planted_faults() {
    let dir = std::env::temp_dir().join(format!("arch-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let w = |p: &str, s: &str| {
        let f = dir.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, s).unwrap();
    };
    w("lib.rs", "pub mod base;\npub mod state;\npub mod config;\n");
    w("base/mod.rs", "pub mod a;\npub mod b;\n");
    // base::a reaches up into config, in a use tree; base::a and base::b import each other.
    w("base/a.rs", "use crate::{state::x, config::{Config as C}};\nuse super::b::B;\npub struct A;\n");
    w("base/b.rs", "// crate::config::Config in a comment is no import\nuse super::a::A;\npub struct B;\nconst S: &str = \"crate::config::X\";\n");
    w("state/mod.rs", "pub mod x;\n#[cfg(test)]\nmod tests { use crate::config::Config; }\n");
    w("state/x.rs", "pub fn f() { proxy_wasm::hostcalls::log(); }\n");
    w("config/mod.rs", "use crate::state::x;\npub struct Config;\n");
    let a = arrows(&dir, &[]);
    let up = upward(&a);
    assert!(up.iter().any(|u| u.starts_with("base::a imports config")), "{up:?}");
    assert!(up.iter().any(|u| u.starts_with("base::a imports state")), "{up:?}");
    assert!(!up.iter().any(|u| u.starts_with("base::b")), "a comment or a string counted: {up:?}");
    assert!(!up.iter().any(|u| u.starts_with("state ")), "a test module counted: {up:?}");
    assert_eq!(circles(&a), vec![vec!["base::a".to_string(), "base::b".to_string()]]);
    let sdk: Vec<_> = modules(&dir)
        .into_iter()
        .filter(|m| tokens(&m.code).iter().any(|t| t == "proxy_wasm"))
        .map(|m| m.path.join("::"))
        .collect();
    assert_eq!(sdk, ["state::x"]);
    // A function of 151 lines (braces in a string and a comment do not end it early), one of
    // 150 lines, and a file of 1,001 lines.
    let body = |n: usize| "    let _ = 1;\n".repeat(n);
    w(
        "state/long.rs",
        &format!("fn long() {{\n    let _ = \"}}\"; // }}\n{}}}\nfn fits() {{\n{}}}\n", body(148), body(148)),
    );
    w("state/big.rs", &"// x\n".repeat(1_001));
    let found = oversized(&dir);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].ends_with("big.rs: 1001 lines (at most 1000)"), "{found:?}");
    assert!(found[1].ends_with("long.rs:1 fn long: 151 lines (at most 150)"), "{found:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

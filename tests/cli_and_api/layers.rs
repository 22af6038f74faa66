//! The module graph of both crates, read from their sources at file level.
//!
//! Every path a file names — in `use` lines and inline, starting with
//! `crate::`, `super::`, `self::` or the name of a child module it declares —
//! is resolved to the file that defines it. The rule, at every level of the
//! module tree: the submodules of a module (each with everything under it)
//! do not depend on each other round a loop. At the crate root that is the
//! old rule (a top-level module names only the ones below it); one level
//! down it forbids `lab/advise.rs` ↔ `lab/report.rs`, or `vstate/` ↔
//! `devices/virtio/` through any of their files.
//!
//! A module's own file (`mod.rs`, `foo.rs`) is not one of its submodules: it
//! declares them, drives them and holds what they share (its error, its
//! arguments), so it may name them and be named by them. It counts as part
//! of its module one level up, like every file under it.
//!
//! Test code (`#[cfg(test)]` items and the files they declare) and comments
//! are left out: unit tests may reach anywhere. A `pub use` is a re-export,
//! not a dependency of the file that makes it: a path through it resolves to
//! the file it points at.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

/// A module's path from the crate root (`["lab", "report"]`; empty for the root).
type Module = Vec<String>;
/// File (relative to the crate's `src/`) → the files its code names.
type Graph = BTreeMap<String, BTreeSet<String>>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

fn is_ident(t: Option<&Tok>, s: &str) -> bool {
    matches!(t, Some(Tok::Ident(i)) if i == s)
}

/// The source as tokens, without comments, literals and lifetimes.
fn tokens(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    // The index after a quoted literal whose opening quote is at `i`.
    let quoted = |mut i: usize, quote: char| {
        i += 1;
        while i < c.len() && c[i] != quote {
            i += if c[i] == '\\' { 2 } else { 1 };
        }
        i + 1
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= c.len() {
                    break;
                } else if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = quoted(i, '"');
        } else if ch == '\'' {
            if at(i + 1) == '\\' || at(i + 2) == '\'' {
                i = quoted(i, '\'');
            } else {
                // A lifetime or label: skip its name too.
                i += 1;
                while ident_char(at(i)) {
                    i += 1;
                }
            }
        } else if ident_char(ch) {
            let start = i;
            while ident_char(at(i)) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            match (word.as_str(), at(i)) {
                ("r" | "br" | "cr", '#' | '"')
                    if at(i) == '"' || matches!(at(i + 1), '#' | '"') =>
                {
                    // A raw string: r"…", r#"…"#…
                    let hashes = c[i..].iter().take_while(|&&h| h == '#').count();
                    i += hashes + 1;
                    while i < c.len() && !(c[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#')) {
                        i += 1;
                    }
                    i += hashes + 1;
                }
                ("r", '#') => {
                    // A raw identifier: r#type.
                    let start = i + 1;
                    i = start;
                    while ident_char(at(i)) {
                        i += 1;
                    }
                    out.push(Tok::Ident(c[start..i].iter().collect()));
                }
                ("b" | "c", '"') => i = quoted(i, '"'),
                ("b", '\'') => i = quoted(i, '\''),
                _ if start_is_digit(&word) => {}
                _ => out.push(Tok::Ident(word)),
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push(Tok::Sep);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

fn start_is_digit(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_digit())
}

/// The index after the bracketed group opening at `i` (`(`, `[` or `{`).
fn group_end(t: &[Tok], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < t.len() {
        match t[i] {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// The tokens without `#[cfg(test)]` items; and the names of the child
/// modules declared that way (`#[cfg(test)] mod tests;`), test-only files.
fn without_tests(t: &[Tok]) -> (Vec<Tok>, BTreeSet<String>) {
    let cfg_test = [
        Tok::Punct('#'),
        Tok::Punct('['),
        Tok::Ident("cfg".into()),
        Tok::Punct('('),
        Tok::Ident("test".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
    ];
    let mut out = Vec::new();
    let mut test_mods = BTreeSet::new();
    let mut i = 0;
    while i < t.len() {
        if !t[i..].starts_with(&cfg_test) {
            out.push(t[i].clone());
            i += 1;
            continue;
        }
        // Skip the item: its other attributes, then up to its `;` or its
        // body's `}` (a field or match arm: up to its `,` or the `}` after it).
        i += cfg_test.len();
        while t.get(i) == Some(&Tok::Punct('#')) {
            i = group_end(t, i + 1);
        }
        let start = i;
        while i < t.len() {
            match t[i] {
                Tok::Punct(';' | ',') => {
                    i += 1;
                    break;
                }
                Tok::Punct('}') => break,
                Tok::Punct('{') => {
                    i = group_end(t, i);
                    break;
                }
                Tok::Punct('(' | '[') => i = group_end(t, i),
                _ => i += 1,
            }
        }
        let item = &t[start..i];
        if let Some(m) = item.iter().position(|x| is_ident(Some(x), "mod")) {
            if let (Some(Tok::Ident(name)), Some(Tok::Punct(';'))) =
                (item.get(m + 1), item.get(m + 2))
            {
                test_mods.insert(name.clone());
            }
        }
    }
    (out, test_mods)
}

/// One path a file names.
#[derive(Debug)]
struct Named {
    /// Its segments as written (`super`, `cache`, `write_atomic`).
    path: Vec<String>,
    /// The module it is written in (a file's module, or an inline one in it).
    scope: Module,
    /// In a `pub use`: the name it is re-exported as, else `None`.
    reexport_as: Option<String>,
}

/// Flattens the use tree starting at `t[*i]` into `out` (paths, each with the
/// name it binds); stops at its end (`;`, or the `,`/`}` after it).
fn use_tree(t: &[Tok], i: &mut usize, prefix: Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
    let mut path = prefix;
    if t.get(*i) == Some(&Tok::Sep) {
        // `::name`: an external crate.
        path.push("::".into());
        *i += 1;
    }
    loop {
        match t.get(*i) {
            Some(Tok::Ident(s)) if s == "self" && !path.is_empty() => {
                *i += 1;
                let name = path.last().unwrap().clone();
                let name = alias(t, i).unwrap_or(name);
                out.push((path, name));
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *i += 1;
                if t.get(*i) == Some(&Tok::Sep) {
                    *i += 1;
                    continue;
                }
                let name = alias(t, i).unwrap_or_else(|| s.clone());
                out.push((path, name));
                return;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((path, "*".into()));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                while !matches!(t.get(*i), None | Some(Tok::Punct('}'))) {
                    use_tree(t, i, path.clone(), out);
                    if t.get(*i) == Some(&Tok::Punct(',')) {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            _ => return,
        }
    }
}

/// `as NAME` at `t[*i]`: the name (consumed).
fn alias(t: &[Tok], i: &mut usize) -> Option<String> {
    if !is_ident(t.get(*i), "as") {
        return None;
    }
    let Some(Tok::Ident(name)) = t.get(*i + 1) else {
        return None;
    };
    *i += 2;
    Some(name.clone())
}

/// What one file holds for the graph.
#[derive(Debug, Default)]
struct FileFacts {
    named: Vec<Named>,
    /// The child modules it declares with `#[cfg(test)] mod name;`.
    test_children: BTreeSet<String>,
    /// `#[macro_export]` macros it defines (they live at the crate root).
    exported_macros: BTreeSet<String>,
}

fn facts(module: &Module, src: &str) -> FileFacts {
    let (t, test_children) = without_tests(&tokens(src));
    let children: BTreeSet<String> = t
        .windows(3)
        .filter_map(|w| match w {
            [Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')] if m == "mod" => Some(name.clone()),
            _ => None,
        })
        .collect();
    // Paths from this crate; the rest (`std::`, `libc::`…) name other crates.
    let ours = |path: &[String]| {
        path.first().is_some_and(|s| {
            matches!(s.as_str(), "crate" | "super" | "self") || children.contains(s)
        })
    };
    let mut f = FileFacts {
        test_children,
        ..FileFacts::default()
    };
    // Inline modules open here: (name, the brace depth inside them).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        let scope: Module = module
            .iter()
            .chain(inline.iter().map(|(n, _)| n))
            .cloned()
            .collect();
        let prev = i.checked_sub(1).map(|p| &t[p]);
        match &t[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if inline.last().is_some_and(|&(_, d)| d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(k) if k == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (t.get(i + 1), t.get(i + 2))
                {
                    inline.push((name.clone(), depth + 1));
                }
            }
            Tok::Ident(k) if k == "macro_rules" => {
                let exported = i >= 2 && is_ident(t.get(i - 2), "macro_export");
                if let (true, Some(Tok::Ident(name))) = (exported, t.get(i + 2)) {
                    f.exported_macros.insert(name.clone());
                }
            }
            Tok::Ident(k) if k == "use" => {
                // `pub use`, `pub(crate) use`…: a re-export.
                let public = is_ident(prev, "pub")
                    || (prev == Some(&Tok::Punct(')'))
                        && (2..6).any(|back| i >= back && is_ident(t.get(i - back), "pub")));
                let mut j = i + 1;
                let mut paths = Vec::new();
                use_tree(&t, &mut j, Vec::new(), &mut paths);
                for (path, name) in paths.into_iter().filter(|(p, _)| ours(p)) {
                    f.named.push(Named {
                        path,
                        scope: scope.clone(),
                        reexport_as: public.then_some(name),
                    });
                }
                i = j;
                continue;
            }
            Tok::Ident(first) if t.get(i + 1) == Some(&Tok::Sep) && prev != Some(&Tok::Sep) => {
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while let (Some(Tok::Sep), Some(Tok::Ident(s))) = (t.get(j), t.get(j + 1)) {
                    path.push(s.clone());
                    j += 2;
                }
                if ours(&path) {
                    f.named.push(Named {
                        path,
                        scope,
                        reexport_as: None,
                    });
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    f
}

/// A file's module: `lab/report.rs` → `lab::report`, `lab/mod.rs` → `lab`.
fn module_of(file: &str) -> Module {
    let mut m: Module = file
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib")) {
        m.pop();
    }
    m
}

/// The file graph of one crate, from its files' texts (paths relative to its
/// `src/`, `/`-separated; `lib.rs` the root).
fn file_graph(sources: &BTreeMap<String, String>) -> Graph {
    let mut facts_of: BTreeMap<String, FileFacts> = sources
        .iter()
        .map(|(file, src)| (file.clone(), facts(&module_of(file), src)))
        .collect();
    // Files only tests declare are test code.
    let test_files: BTreeSet<String> = facts_of
        .iter()
        .flat_map(|(file, f)| {
            let parent = module_of(file);
            f.test_children.iter().map(move |c| {
                let mut m = parent.clone();
                m.push(c.clone());
                m
            })
        })
        .flat_map(|m| {
            facts_of
                .keys()
                .filter(move |f| module_of(f) == m)
                .cloned()
                .collect::<Vec<_>>()
        })
        .collect();
    facts_of.retain(|file, _| !test_files.contains(file));
    let files: BTreeMap<Module, String> =
        facts_of.keys().map(|f| (module_of(f), f.clone())).collect();
    let macros: BTreeMap<String, String> = facts_of
        .iter()
        .flat_map(|(file, f)| {
            f.exported_macros
                .iter()
                .map(move |m| (m.clone(), file.clone()))
        })
        .collect();
    // Per file: the names it re-exports → the absolute paths they stand for.
    let mut reexports: BTreeMap<String, BTreeMap<String, Module>> = BTreeMap::new();
    for (file, f) in &facts_of {
        for n in &f.named {
            if let (Some(name), Some(abs)) = (&n.reexport_as, absolute(&n.path, &n.scope)) {
                reexports
                    .entry(file.clone())
                    .or_default()
                    .insert(name.clone(), abs);
            }
        }
    }
    let resolve = |abs: &Module| -> Option<String> {
        let mut abs = abs.clone();
        for _ in 0..16 {
            if let Some(file) = abs.first().and_then(|m| macros.get(m)) {
                return Some(file.clone());
            }
            let (file, rest) = (0..=abs.len())
                .rev()
                .find_map(|k| files.get(&abs[..k]).map(|f| (f, &abs[k..])))?;
            match rest.first().and_then(|name| reexports.get(file)?.get(name)) {
                Some(target) => abs = target.iter().chain(&rest[1..]).cloned().collect(),
                None => return Some(file.clone()),
            }
        }
        None
    };
    let mut g = Graph::new();
    for (file, f) in &facts_of {
        let edges = g.entry(file.clone()).or_default();
        for n in f.named.iter().filter(|n| n.reexport_as.is_none()) {
            if let Some(target) = absolute(&n.path, &n.scope).and_then(|abs| resolve(&abs)) {
                if &target != file {
                    edges.insert(target);
                }
            }
        }
    }
    g
}

/// A path as written in module `scope`, from the crate root; `None` for an
/// external crate's.
fn absolute(path: &[String], scope: &Module) -> Option<Module> {
    let mut base = scope.clone();
    let mut rest = path;
    match path.first()?.as_str() {
        "crate" => {
            base.clear();
            rest = &path[1..];
        }
        "self" => rest = &path[1..],
        "super" => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        "::" => return None,
        // A child module's name (the only other relative paths collected).
        _ => {}
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The `.rs` files under `root`, relative and `/`-separated, with their text;
/// `main.rs` (a binary, another crate) left out.
fn read_sources(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                if rel != "main.rs" {
                    out.insert(rel, std::fs::read_to_string(&p).unwrap());
                }
            }
        }
    }
    out
}

/// The submodule of `m` that `file` is in (its name), or `None` when the
/// file is `m`'s own or outside `m`.
fn unit_in(m: &[String], file: &str) -> Option<String> {
    let fm = module_of(file);
    (fm.len() > m.len() && fm.starts_with(m)).then(|| fm[m.len()].clone())
}

/// Every loop between the submodules of one module, at every level, each
/// with the file edges that make it.
fn loops(files: &Graph) -> Vec<String> {
    let levels: BTreeSet<Module> = files
        .keys()
        .flat_map(|f| {
            let m = module_of(f);
            (0..m.len()).map(move |k| m[..k].to_vec())
        })
        .collect();
    let mut out = Vec::new();
    for m in &levels {
        let mut g = Graph::new();
        // (submodule, submodule) → the first file edge between them.
        let mut witness = BTreeMap::new();
        for (from, tos) in files {
            let Some(a) = unit_in(m, from) else { continue };
            for to in tos {
                if let Some(b) = unit_in(m, to).filter(|b| *b != a) {
                    witness
                        .entry((a.clone(), b.clone()))
                        .or_insert_with(|| format!("{from} → {to}"));
                    g.entry(a.clone()).or_default().insert(b);
                }
            }
        }
        for c in cycles(&g) {
            let why: Vec<&str> = c
                .windows(2)
                .map(|w| witness[&(w[0].clone(), w[1].clone())].as_str())
                .collect();
            let place = if m.is_empty() {
                "top-level modules".to_owned()
            } else {
                format!("submodules of {}", m.join("::"))
            };
            out.push(format!(
                "{place} depend on each other: {} ({})",
                c.join(" → "),
                why.join(", ")
            ));
        }
    }
    out
}

/// One cycle (first node repeated at the end) for each group of nodes that
/// reach each other, shortest through the group's first node.
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for m in g.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for (n, r) in &reaches {
        if done.contains(*n) || !r.contains(*n) {
            continue;
        }
        let group: BTreeSet<String> = r
            .iter()
            .filter(|m| reaches.get(m).is_some_and(|rm| rm.contains(*n)))
            .cloned()
            .collect();
        // Breadth first within the group, back to `n`.
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = VecDeque::from([(*n).clone()]);
        'search: while let Some(a) = queue.pop_front() {
            for b in g
                .get(&a)
                .into_iter()
                .flatten()
                .filter(|b| group.contains(*b))
            {
                if b == *n {
                    let mut c = vec![a.clone()];
                    while let Some(p) = prev.get(c.last().unwrap()) {
                        c.push(p.clone());
                    }
                    c.reverse();
                    c.push(b.clone());
                    out.push(c);
                    break 'search;
                }
                if !prev.contains_key(b) {
                    prev.insert(b.clone(), a.clone());
                    queue.push_back(b.clone());
                }
            }
        }
        done.extend(group);
    }
    out
}

fn assert_acyclic(root: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(root);
    let files = file_graph(&read_sources(&root));
    let edges: usize = files.values().map(BTreeSet::len).sum();
    assert!(
        files.len() >= 10 && edges >= 20,
        "the file graph of {} looks empty: {files:?}",
        root.display()
    );
    let loops = loops(&files);
    assert!(
        loops.is_empty(),
        "{}:\n{}",
        root.display(),
        loops.join("\n")
    );
}

#[test]
fn ember_vmm_has_no_module_cycle() {
    assert_acyclic("crates/ember-vmm/src");
}

#[test]
fn ember_has_no_module_cycle() {
    assert_acyclic("src");
}

fn graph_of(files: &[(&str, &str)]) -> Graph {
    file_graph(
        &files
            .iter()
            .map(|(f, s)| ((*f).into(), (*s).into()))
            .collect(),
    )
}

fn edges(g: &Graph, from: &str) -> Vec<String> {
    g.get(from).into_iter().flatten().cloned().collect()
}

#[test]
fn every_kind_of_path_is_resolved_to_its_file() {
    let g = graph_of(&[
        ("lib.rs", "pub mod a; pub mod b; mod c;"),
        (
            "a/mod.rs",
            "mod x; mod y; pub use y::Y; pub fn f() { x::g(); }",
        ),
        (
            "a/x.rs",
            "use super::{Y, f as g, y::{self}};\n\
             // crate::c::nothing (a comment)\n\
             fn h() -> &'static str { let _ = crate::b::B::new(); \"crate::c::\" }",
        ),
        ("a/y.rs", "pub struct Y; mod inner { use super::Y; }"),
        (
            "b.rs",
            "pub struct B { #[cfg(test)] t: crate::c::C, n: u8 }\n\
             const S: &str = r#\"crate::c::\"#; const Q: char = '\"';\n\
             #[cfg(test)]\nmod tests { use crate::c::C; }",
        ),
        (
            "c.rs",
            "use self::d::D; mod d; pub fn k() { crate::a::f(); }",
        ),
        ("c/d.rs", "pub struct D;"),
    ]);
    // `Y` through a/mod.rs's re-export is a/y.rs; `f` is a/mod.rs's own.
    assert_eq!(edges(&g, "a/x.rs"), ["a/mod.rs", "a/y.rs", "b.rs"]);
    assert_eq!(edges(&g, "a/mod.rs"), ["a/x.rs"]);
    assert_eq!(edges(&g, "a/y.rs"), Vec::<String>::new());
    assert_eq!(edges(&g, "b.rs"), Vec::<String>::new());
    assert_eq!(edges(&g, "c.rs"), ["a/mod.rs", "c/d.rs"]);
}

#[test]
fn a_loop_between_sibling_files_is_found() {
    let g = graph_of(&[
        ("lib.rs", "pub mod lab;"),
        (
            "lab/mod.rs",
            "pub mod advise; pub mod report; pub mod stats;",
        ),
        (
            "lab/advise.rs",
            "use super::stats::mean; pub fn advise() { super::report::num(1); }",
        ),
        (
            "lab/report.rs",
            "use crate::lab::advise::advise;\npub fn num(_: u32) {}",
        ),
        ("lab/stats.rs", "pub fn mean() {}"),
    ]);
    assert_eq!(
        loops(&g),
        [
            "submodules of lab depend on each other: advise → report → advise \
          (lab/advise.rs → lab/report.rs, lab/report.rs → lab/advise.rs)"
        ]
    );
}

#[test]
fn a_loop_between_top_level_modules_is_found() {
    let mut g = Graph::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        g.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(cycles(&g), [["a", "b", "c", "a"]]);
    g.get_mut("c").unwrap().remove("a");
    assert!(cycles(&g).is_empty());
    // No two files name each other, but a/x.rs → b.rs → a/y.rs.
    let files = graph_of(&[
        ("lib.rs", "pub mod a; pub mod b;"),
        ("a/mod.rs", "mod x; mod y;"),
        ("a/x.rs", "use crate::b::B;"),
        ("a/y.rs", "pub struct Y;"),
        ("b.rs", "pub struct B; fn f() -> crate::a::y::Y { todo!() }"),
    ]);
    assert_eq!(
        loops(&files),
        ["top-level modules depend on each other: a → b → a (a/x.rs → b.rs, b.rs → a/y.rs)"]
    );
}

#[test]
fn a_module_file_may_drive_its_submodules_and_lend_them_its_vocabulary() {
    let mut sources = vec![
        ("lib.rs", "pub mod block;"),
        (
            "block/mod.rs",
            "mod event_loop; mod handler; pub const SECTOR: u64 = 512;\n\
             pub fn spawn() { event_loop::run(); }",
        ),
        (
            "block/event_loop.rs",
            "use super::handler::Handler; pub fn run() {}",
        ),
        (
            "block/handler/mod.rs",
            "use super::SECTOR; pub struct Handler;",
        ),
    ];
    assert!(loops(&graph_of(&sources)).is_empty());
    // But the module as a whole, seen from its parent, is one unit: here
    // it and a sibling (through the module's own file) name each other.
    sources[0].1 = "pub mod block; pub mod guest;";
    sources[3].1 = "use super::SECTOR; use crate::guest::Mem; pub struct Handler;";
    sources.push((
        "guest.rs",
        "pub struct Mem; fn f() { crate::block::spawn() }",
    ));
    assert_eq!(
        loops(&graph_of(&sources)),
        [
            "top-level modules depend on each other: block → guest → block \
          (block/handler/mod.rs → guest.rs, guest.rs → block/mod.rs)"
        ]
    );
}

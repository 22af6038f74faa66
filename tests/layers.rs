//! The module graph of both crates has no cycle: a module names
//! (`crate::other`) only modules below it. Read from the sources, test code
//! and comments left out, so a new upward dependency fails here with the
//! cycle it makes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its code names.
fn graph(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeSet<String> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| {
            e.file_name()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned()
        })
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(root).unwrap();
            let top = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned();
            if !modules.contains(&top) || p.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            // Unit tests may reach anywhere; the code may not.
            let code = text.split("#[cfg(test)]").next().unwrap();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let name: String = line[i + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if name != top && modules.contains(&name) {
                        g.entry(top.clone()).or_default().insert(name);
                    }
                }
            }
        }
    }
    g
}

/// A cycle through `from`, if there is one.
fn cycle(g: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>) -> Option<Vec<String>> {
    let last = path.last().unwrap().clone();
    for next in g.get(&last).into_iter().flatten() {
        if let Some(at) = path.iter().position(|m| m == next) {
            let mut c = path[at..].to_vec();
            c.push(next.clone());
            return Some(c);
        }
        path.push(next.clone());
        if let Some(c) = cycle(g, path) {
            return Some(c);
        }
        path.pop();
    }
    None
}

fn assert_acyclic(root: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(root);
    let g = graph(&root);
    assert!(
        g.len() >= 4,
        "the graph of {} looks empty: {g:?}",
        root.display()
    );
    for start in g.keys() {
        if let Some(c) = cycle(&g, &mut vec![start.clone()]) {
            panic!(
                "{}: modules depend on each other: {}",
                root.display(),
                c.join(" → ")
            );
        }
    }
}

#[test]
fn ember_vmm_has_no_module_cycle() {
    assert_acyclic("crates/ember-vmm/src");
}

#[test]
fn ember_has_no_module_cycle() {
    assert_acyclic("src");
}

#[test]
fn a_cycle_is_found() {
    let mut g = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        g.entry(a.to_owned())
            .or_insert_with(BTreeSet::new)
            .insert(b.to_owned());
    }
    assert_eq!(
        cycle(&g, &mut vec!["a".into()]),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    g.get_mut("c").unwrap().remove("a");
    assert_eq!(cycle(&g, &mut vec!["a".into()]), None);
}

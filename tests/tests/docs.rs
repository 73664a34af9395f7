//! The docs are checked like code: every relative link and anchor resolves, every
//! identifier and repository path they name in backticks exists, every `sortie`
//! subcommand is in the CLI reference, every route of the gateway is in the HTTP
//! reference, and the README stays a short manual (at most 300 lines, no commit hashes).
//! No broker: these run in a second.
//!
//! Checked red: a link to a heading that was renamed, a test name with a typo, a
//! subcommand missing from `docs/reference/cli.md` and a 301st README line each failed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use sortie_tests::workspace_root;

/// Directories whose Markdown is not the project's docs (build output, vendored or
/// generated material).
const SKIP_DIRS: &[&str] = &["target", ".git", "node_modules", "corpus", ".venv", "venv"];

fn walk(dir: &Path, keep: &dyn Fn(&Path) -> bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !SKIP_DIRS.contains(&name.as_str()) {
                walk(&path, keep, out);
            }
        } else if keep(&path) {
            out.push(path);
        }
    }
}

fn markdown_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(
        &workspace_root(),
        &|p| p.extension().is_some_and(|e| e == "md"),
        &mut out,
    );
    out.sort();
    out
}

/// The text of every source file an identifier may live in.
fn sources() -> String {
    let mut files = Vec::new();
    let root = workspace_root();
    for dir in [
        "services", "tests", "fuzz", "examples", "dev", "topology", "helm", "schemas", ".ci",
    ] {
        walk(
            &root.join(dir),
            &|p| {
                p.extension().is_some_and(|e| {
                    [
                        "rs", "yaml", "yml", "avsc", "py", "go", "js", "sh", "toml", "json", "tpl",
                        "html", "css",
                    ]
                    .contains(&e.to_string_lossy().as_ref())
                })
            },
            &mut files,
        );
    }
    files
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The lines of `text` outside fenced code blocks, with their numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((n + 1, line));
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
/// spaces to `-`; repeats get `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let trimmed = line.trim_start();
        if let Some(heading) = trimmed.strip_prefix('#') {
            let heading = heading.trim_start_matches('#');
            if !heading.starts_with(' ') {
                continue;
            }
            let slug: String = heading
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect();
            let n = seen.entry(slug.clone()).or_insert(0);
            out.insert(if *n == 0 {
                slug.clone()
            } else {
                format!("{slug}-{n}")
            });
            *n += 1;
        }
        // Explicit anchors: <a id="x"></a> or <a name="x">.
        for marker in ["<a id=\"", "<a name=\""] {
            let mut rest = line;
            while let Some(at) = rest.find(marker) {
                rest = &rest[at + marker.len()..];
                if let Some(end) = rest.find('"') {
                    out.insert(rest[..end].to_owned());
                }
            }
        }
    }
    out
}

/// The targets of the Markdown links and images on a line: `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].trim().trim_matches(['<', '>']);
        // `[text](url "title")`
        let target = target.split_whitespace().next().unwrap_or("");
        out.push(target.to_owned());
        rest = &rest[end..];
    }
    out
}

/// The spans of `line` in single backticks.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect()
}

fn relative(path: &Path) -> String {
    path.strip_prefix(workspace_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut cache: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).expect("read");
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                if target.is_empty()
                    || target.contains("://")
                    || target.starts_with("mailto:")
                    || target.starts_with('/')
                {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().expect("dir").join(path)
                };
                if !resolved.exists() {
                    broken.push(format!("{}:{n}: {target} (no such file)", relative(&file)));
                    continue;
                }
                if let Some(anchor) = anchor {
                    if resolved.extension().is_some_and(|e| e == "md") {
                        let known = cache.entry(resolved.clone()).or_insert_with(|| {
                            anchors(&std::fs::read_to_string(&resolved).unwrap_or_default())
                        });
                        if !known.contains(anchor) {
                            broken.push(format!(
                                "{}:{n}: {target} (no such heading)",
                                relative(&file)
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// A snake_case name of three words or more in backticks is an identifier of the code (a
/// test, a function, a field, a metric, a config key): it must occur in the sources. A
/// path of the repository in backticks must exist.
#[test]
fn every_identifier_and_path_the_docs_name_exists() {
    let sources = sources();
    let root = workspace_root();
    let top: BTreeSet<String> = std::fs::read_dir(&root)
        .expect("root")
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !SKIP_DIRS.contains(&name.as_str()))
        .collect();
    let is_identifier = |s: &str| {
        s.split('_').count() >= 3
            && s.split('_').all(|w| {
                !w.is_empty()
                    && w.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
            })
            && s.starts_with(|c: char| c.is_ascii_lowercase())
    };
    let mut missing = BTreeSet::new();
    for file in markdown_files() {
        if relative(&file).starts_with("docs/performance/log.md") {
            // The diary names what existed at the time.
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read");
        for (n, line) in prose(&text) {
            for span in code_spans(line) {
                let span = span.trim();
                // `fn name`, `name()`, `module::name`: the last path segment.
                let name = span
                    .trim_start_matches("fn ")
                    .trim_end_matches("()")
                    .rsplit("::")
                    .next()
                    .unwrap_or(span);
                if is_identifier(name) && !sources.contains(name) {
                    missing.insert(format!("{}:{n}: `{span}`", relative(&file)));
                }
                let first = span.split('/').next().unwrap_or("");
                let path_like = span.contains('/')
                    && top.contains(first)
                    && !span.contains(|c: char| c.is_whitespace() || "*{}<>$|…".contains(c));
                if path_like {
                    let path = span.split(['#', ':']).next().unwrap_or(span);
                    if !root.join(path).exists() {
                        missing.insert(format!("{}:{n}: `{span}` (no such path)", relative(&file)));
                    }
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name what does not exist:\n{}",
        missing.into_iter().collect::<Vec<_>>().join("\n")
    );
}

/// The subcommands clap prints under `Commands:`, `help` left out.
fn subcommands(args: &[&str]) -> Vec<String> {
    let output = Command::new(sortie_tests::stack::sortie_bin())
        .args(args)
        .arg("--help")
        .output()
        .expect("sortie --help");
    let help = String::from_utf8_lossy(&output.stdout).into_owned();
    let Some(at) = help.find("Commands:") else {
        return Vec::new();
    };
    help[at..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_subcommand_is_in_the_cli_reference() {
    let reference = std::fs::read_to_string(workspace_root().join("docs/reference/cli.md"))
        .expect("docs/reference/cli.md");
    let mut missing = Vec::new();
    let top = subcommands(&[]);
    assert!(top.len() > 10, "sortie --help listed {top:?}");
    for command in &top {
        if !reference.contains(&format!("sortie {command}")) {
            missing.push(format!("sortie {command}"));
        }
        // A subcommand is named in full, or in its command's section (`## \`sortie run\``)
        // as `sub ...` (a table row).
        let heading = format!("## `sortie {command}`");
        let section = reference
            .find(&heading)
            .map(|at| {
                let rest = &reference[at + heading.len()..];
                &rest[..rest.find("\n## ").unwrap_or(rest.len())]
            })
            .unwrap_or_default();
        for sub in subcommands(&[command]) {
            let named = reference.contains(&format!("sortie {command} {sub}"))
                || section.contains(&format!("`{sub} "))
                || section.contains(&format!("`{sub}`"));
            if !named {
                missing.push(format!("sortie {command} {sub}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/reference/cli.md does not describe: {missing:?}"
    );
}

#[test]
fn every_route_is_in_the_http_reference() {
    let reference = std::fs::read_to_string(workspace_root().join("docs/reference/http-api.md"))
        .expect("docs/reference/http-api.md");
    let missing: Vec<String> = sortie_gateway::ROUTES
        .iter()
        .map(|(method, path)| format!("{method} {path}"))
        .filter(|route| !reference.contains(route.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/reference/http-api.md does not describe: {missing:?} (write each as `METHOD /path`)"
    );
}

#[test]
fn the_readme_is_a_short_manual_without_commit_hashes() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).expect("README");
    let lines = readme.lines().count();
    assert!(lines <= 300, "README.md has {lines} lines; at most 300");
    let hashes: Vec<&str> = readme
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| {
            (7..=40).contains(&w.len())
                && w.chars()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
                && w.chars().any(|c| c.is_ascii_digit())
                && w.chars().any(|c| c.is_ascii_alphabetic())
        })
        .collect();
    assert!(
        hashes.is_empty(),
        "README.md names commits ({hashes:?}): figures' history goes to docs/performance/log.md"
    );
}

#[test]
fn architecture_says_what_is_true_now() {
    let text =
        std::fs::read_to_string(workspace_root().join("ARCHITECTURE.md")).expect("ARCHITECTURE");
    let lines = text.lines().count();
    assert!(
        lines <= 600,
        "ARCHITECTURE.md has {lines} lines; at most 600"
    );
    for unresolvable in ["SPEC §", "../shared", "issue #", "closing note"] {
        assert!(
            !text.contains(unresolvable),
            "ARCHITECTURE.md refers to {unresolvable:?}, which a clone cannot resolve"
        );
    }
}

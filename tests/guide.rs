//! The guide's links and wiring, checked without a database or a network: for `README.md`
//! and every chapter under `guide/src/`,
//!
//! - every relative markdown link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`,
//!   images included) resolves to a file or directory of the repository, relative to the
//!   file that links, and an `#anchor` into a markdown file matches one of that file's
//!   headings under GitHub's and mdBook's slug rule (lowercase; alphanumerics, `-` and `_`
//!   kept; spaces become `-`; other punctuation dropped; a repeated heading gets `-1`,
//!   `-2`, …). Links inside code blocks and inline code are not links. `http://`,
//!   `https://` and `mailto:` links are skipped: the CI machine has no network;
//! - every `.md` file under `guide/src/` is listed in `guide/src/SUMMARY.md`, and every
//!   file `SUMMARY.md` lists exists;
//! - every chapter is compiled as a doctest: its path appears in an `include_str!` of
//!   `src/lib.rs` (the crate's `#[cfg(doctest)]` items).
//!
//! A failure lists every problem found, each as `file:line`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The repository's root: this package's manifest directory.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.md` file under `dir`, sorted.
fn markdown_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == "md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// `path` relative to the repository's root, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// `path` with `.` and `..` resolved, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The text of each line outside fenced code blocks, with inline code blanked out
/// (replaced by spaces, so that columns and line numbers stay), one entry per line.
fn prose_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut fence: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let marker: String = trimmed
            .chars()
            .take_while(|&c| c == '`' || c == '~')
            .collect();
        if let Some(open) = &fence {
            if marker.len() >= open.len() && marker.starts_with(&open[..1]) {
                fence = None;
            }
            lines.push(String::new());
            continue;
        }
        if marker.len() >= 3 && marker.chars().all(|c| c == marker.as_bytes()[0] as char) {
            fence = Some(marker);
            lines.push(String::new());
            continue;
        }
        lines.push(line.to_owned());
    }
    blank_inline_code(&lines)
}

/// Blanks every inline code span of `lines` (a span may run over a line break, as in a
/// wrapped paragraph): its backticks and its text become spaces.
fn blank_inline_code(lines: &[String]) -> Vec<String> {
    let joined = lines.join("\n");
    let chars: Vec<char> = joined.chars().collect();
    let mut out = chars.clone();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|&&c| c == '`').count();
        // The closing run: the same number of backticks, not part of a longer run, before a
        // blank line (a span never crosses a paragraph).
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '\n' && chars.get(j + 1) == Some(&'\n') {
                break;
            }
            if chars[j] == '`' {
                let other = chars[j..].iter().take_while(|&&c| c == '`').count();
                if other == run {
                    close = Some(j);
                    break;
                }
                j += other;
                continue;
            }
            j += 1;
        }
        match close {
            Some(j) => {
                for c in &mut out[i..j + run] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = j + run;
            }
            None => i += run,
        }
    }
    out.into_iter()
        .collect::<String>()
        .split('\n')
        .map(str::to_owned)
        .collect()
}

/// Every link target of `lines` (outside code), with its 1-based line: the `(…)` after a
/// `]`, the link text possibly spread over several lines.
fn links(lines: &[String]) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].trim();
            // `[text](target "title")`: the target is the first word.
            let target = target.split_whitespace().next().unwrap_or("");
            found.push((n + 1, target.to_owned()));
            rest = &after[end + 1..];
        }
    }
    found
}

/// A heading's anchor under GitHub's and mdBook's rule: lowercase; alphanumerics, `-` and
/// `_` kept; spaces become `-`; everything else dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                Some(c.to_lowercase().collect::<String>())
            } else if c == ' ' {
                Some("-".to_owned())
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of a markdown file's ATX headings (`#` to `######`, outside code), a repeated
/// one numbered as both renderers number it.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !trimmed[hashes..].starts_with(' ') {
            continue;
        }
        let heading = trimmed[hashes..].trim().trim_end_matches('#').trim();
        let base = slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The files the link check reads: the README and every chapter.
fn checked_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    files.extend(markdown_files(&root().join("guide/src")));
    files
}

/// Every broken relative link of `file`, as `file:line: …`.
fn broken_links(file: &Path) -> Vec<String> {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let dir = file.parent().expect("a file's directory");
    let mut problems = Vec::new();
    for (line, target) in links(&prose_lines(&text)) {
        let at = format!("{}:{line}", shown(file));
        if target.is_empty() {
            problems.push(format!("{at}: an empty link target"));
            continue;
        }
        if ["http://", "https://", "mailto:"]
            .iter()
            .any(|scheme| target.starts_with(scheme))
        {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let linked = if path.is_empty() {
            file.to_path_buf()
        } else {
            normalize(&dir.join(path))
        };
        if !linked.starts_with(root()) {
            problems.push(format!("{at}: {target} leaves the repository"));
            continue;
        }
        if !linked.exists() {
            problems.push(format!("{at}: {target}: no such file ({})", shown(&linked)));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if linked.extension().is_none_or(|ext| ext != "md") {
            continue;
        }
        let headings = anchors(&fs::read_to_string(&linked).expect("a linked markdown file"));
        if !headings.contains(anchor) {
            problems.push(format!(
                "{at}: {target}: {} has no heading with the anchor #{anchor}",
                shown(&linked)
            ));
        }
    }
    problems
}

#[test]
fn every_relative_link_resolves() {
    let problems: Vec<String> = checked_files()
        .iter()
        .flat_map(|file| broken_links(file))
        .collect();
    assert!(
        problems.is_empty(),
        "{} broken links:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn summary_lists_every_chapter() {
    let src = root().join("guide/src");
    let summary_file = src.join("SUMMARY.md");
    let summary = fs::read_to_string(&summary_file).expect("guide/src/SUMMARY.md");
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for (line, target) in links(&prose_lines(&summary)) {
        let path = normalize(&src.join(&target));
        if !path.is_file() {
            problems.push(format!(
                "{}:{line}: {target}: no such chapter",
                shown(&summary_file)
            ));
        }
        listed.insert(path);
    }
    for chapter in markdown_files(&src) {
        if chapter != summary_file && !listed.contains(&chapter) {
            problems.push(format!(
                "{}: not listed in guide/src/SUMMARY.md",
                shown(&chapter)
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_chapter_is_a_doctest() {
    let lib = fs::read_to_string(root().join("src/lib.rs")).expect("src/lib.rs");
    let src = root().join("guide/src");
    let problems: Vec<String> = markdown_files(&src)
        .into_iter()
        .filter(|chapter| !chapter.ends_with("SUMMARY.md"))
        .filter_map(|chapter| {
            let include = format!("include_str!(\"../{}\")", shown(&chapter));
            (!lib.contains(&include)).then(|| {
                format!(
                    "{}: not compiled as a doctest: src/lib.rs has no `#[doc = {include}]`",
                    shown(&chapter)
                )
            })
        })
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn slugs_follow_the_renderers() {
    assert_eq!(slug("The operator's command"), "the-operators-command");
    assert_eq!(
        slug("Batches of messages: `run_batches`"),
        "batches-of-messages-run_batches"
    );
    assert_eq!(
        slug("Publishing from a handler: the outbox"),
        "publishing-from-a-handler-the-outbox"
    );
    let repeated = anchors("# A\n\n## Notes\n\n```text\n# not a heading\n```\n\n## Notes\n");
    assert!(repeated.contains("notes") && repeated.contains("notes-1"));
    assert!(!repeated.contains("not-a-heading"));
}

//! The crate graph stays layered (ARCHITECTURE.md, "Crates"): no crate but the CLI
//! depends on `sortie-reducer`. The gateway must never ask the reducer anything, and the
//! bench and executor read the topics through the shared layer (`sortie-model`,
//! `sortie-catalog`), so none of them may link the reducer's transactional driver or sled
//! store. Nor may a production service (`sortie-executor`, `sortie-gateway`,
//! `sortie-reducer`, `sortie-kafka`, and the layers below them) link `sortie-devkit`, the
//! dev and test machinery (the broker launcher, the ledger, the dev receiver).
//! `cargo tree` over the lockfile proves it, offline; no broker is needed.

use std::path::Path;
use std::process::Command;

/// Every workspace crate except the CLI (`sortie`) and the reducer itself.
const MUST_NOT_LINK_THE_REDUCER: &[&str] = &[
    "sortie-core",
    "sortie-blob",
    "sortie-wire",
    "sortie-model",
    "sortie-kafka",
    "sortie-catalog",
    "sortie-mcp",
    "sortie-why",
    "sortie-registry",
    "sortie-executor",
    "sortie-gateway",
    "sortie-bench",
];

/// Production crates and the layers they stand on: none may link the dev machinery.
/// (Seen red: with `sortie-devkit` added to `sortie-executor`'s dependencies, the test
/// below fails naming the executor.)
const MUST_NOT_LINK_THE_DEVKIT: &[&str] = &[
    "sortie-core",
    "sortie-blob",
    "sortie-wire",
    "sortie-model",
    "sortie-kafka",
    "sortie-catalog",
    "sortie-mcp",
    "sortie-why",
    "sortie-executor",
    "sortie-gateway",
    "sortie-reducer",
];

fn tree(package: &str) -> String {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let output = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--locked", "--manifest-path"])
        .arg(&manifest)
        .args(["-p", package, "-e", "normal,build", "--prefix", "none"])
        .args(["--format", "{p}"])
        .output()
        .expect("run cargo tree");
    assert!(
        output.status.success(),
        "cargo tree -p {package} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("cargo tree prints UTF-8")
}

fn depends_on(tree: &str, package: &str) -> bool {
    tree.lines()
        .any(|line| line.split_whitespace().next() == Some(package))
}

#[test]
fn no_crate_but_the_cli_depends_on_the_reducer() {
    for package in MUST_NOT_LINK_THE_REDUCER {
        let tree = tree(package);
        assert!(
            depends_on(&tree, package),
            "cargo tree -p {package} does not list the package itself:\n{tree}"
        );
        assert!(
            !depends_on(&tree, "sortie-reducer"),
            "{package} depends on sortie-reducer:\n{tree}"
        );
    }
}

/// The check above would pass vacuously if `cargo tree` listed nothing: the CLI does
/// depend on the reducer, and the same query must see it.
#[test]
fn the_cli_does_depend_on_the_reducer() {
    assert!(depends_on(&tree("sortie"), "sortie-reducer"));
}

#[test]
fn no_production_crate_depends_on_the_devkit() {
    for package in MUST_NOT_LINK_THE_DEVKIT {
        let tree = tree(package);
        assert!(
            depends_on(&tree, package),
            "cargo tree -p {package} does not list the package itself:\n{tree}"
        );
        for machinery in ["sortie-devkit", "sortie-fuzz"] {
            assert!(
                !depends_on(&tree, machinery),
                "{package} depends on {machinery} (dev and test machinery):\n{tree}"
            );
        }
    }
}

/// Not vacuous: the CLI (`sortie dev`, `sortie broker`, `sortie ledger`) links the devkit,
/// and the same query sees it.
#[test]
fn the_cli_does_depend_on_the_devkit() {
    assert!(depends_on(&tree("sortie"), "sortie-devkit"));
}

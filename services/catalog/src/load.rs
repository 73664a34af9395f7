//! Loading graph files (YAML or JSON) from disk.

use std::path::Path;

use sortie_core::Graph;

use crate::Error;

/// Parses and validates one graph file (YAML or JSON).
pub fn load_file(path: impl AsRef<Path>) -> Result<Graph, Error> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    Graph::parse(&text).map_err(|source| Error::InvalidFile {
        path: path.to_owned(),
        source,
    })
}

/// Parses every `*.yaml`, `*.yml` and `*.json` file in a folder (not recursive), in file
/// name order. The first invalid file fails the whole load, naming the file and its
/// problems.
pub fn load_dir(path: impl AsRef<Path>) -> Result<Vec<Graph>, Error> {
    let dir = path.as_ref();
    let io = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let graph_file = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
        if graph_file && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    files.iter().map(load_file).collect()
}

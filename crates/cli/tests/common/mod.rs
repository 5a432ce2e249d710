//! Helpers shared by the CLI tests: running the built `qforge` binary and finding examples.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the `qforge` binary built for these tests with `args`.
pub fn qforge<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge")).args(args).output().expect("qforge runs")
}

/// Command output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A file of the repository's `examples/` folder.
pub fn example(name: &str) -> PathBuf {
    qforge_testkit::repo().join("examples").join(name)
}

//! The default binary loads libibverbs at run time: without the library (simulated by pointing
//! the loader at a name that does not exist, `PHALANX_LIBIBVERBS`) or without a device, a
//! node whose config says `transport = "rdma"` fails within a second with one clear line,
//! and `phalanx info` says what is missing and exits 0.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

const MISSING: &str = "libibverbs-phalanx-test-missing.so.1";
const NOT_FOUND: &str = "libibverbs.so.1 not found: install rdma-core / libibverbs1";

fn phalanx(args: &[&str], missing_lib: bool) -> (Output, Duration) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_phalanx"));
    c.args(args).env("RUST_LOG", "warn");
    if missing_lib {
        c.env("PHALANX_LIBIBVERBS", MISSING);
    } else {
        c.env_remove("PHALANX_LIBIBVERBS");
    }
    let t0 = Instant::now();
    let out = c.output().expect("run phalanx");
    (out, t0.elapsed())
}

fn rdma_config() -> tempfile_path::Path {
    tempfile_path::Path::new(
        "transport = \"rdma\"\nsecret = \"a secret for the verbs loading tests\"\n[[nodes]]\nid = 0\naddr = \"127.0.0.1:0\"\n[[nodes]]\nid = 1\naddr = \"127.0.0.1:1\"\n",
    )
}

/// A config file that removes itself.
mod tempfile_path {
    pub struct Path(pub std::path::PathBuf);
    impl Path {
        pub fn new(text: &str) -> Path {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "phalanx-verbs-loading-{}-{}.toml",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&p, text).unwrap();
            Path(p)
        }
        pub fn as_str(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }
    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn stderr_lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn rdma_node_without_libibverbs_fails_fast_with_one_line() {
    let cfg = rdma_config();
    let (out, took) = phalanx(&["node", "--config", cfg.as_str(), "--id", "0"], true);
    let lines = stderr_lines(&out);
    println!("{took:?}: {lines:?}");
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(lines.len(), 1, "one line: {lines:?}");
    assert!(lines[0].starts_with("phalanx: error: "), "{lines:?}");
    assert!(lines[0].contains(NOT_FOUND), "{lines:?}");
    assert!(lines[0].contains(MISSING), "dlerror detail: {lines:?}");
    assert_eq!(lines[0].matches(NOT_FOUND).count(), 1, "{lines:?}");
}

#[test]
fn demo_over_rdma_without_libibverbs_fails_fast_too() {
    let (out, took) = phalanx(
        &[
            "demo",
            "--nodes",
            "2",
            "--size",
            "1K",
            "--transport",
            "rdma",
        ],
        true,
    );
    let lines = stderr_lines(&out);
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains(NOT_FOUND), "{lines:?}");
}

#[test]
fn info_without_libibverbs_says_so_and_exits_0() {
    let (out, _) = phalanx(&["info"], true);
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(out.status.success());
    assert!(text.contains(NOT_FOUND), "{text}");
    assert!(
        text.contains("RDMA devices: none (no verbs library)"),
        "{text}"
    );
    assert!(text.contains("transport: tcp"), "{text}");
}

/// On this machine as it is: a host without RDMA devices (with or without libibverbs) gives
/// the matching clear line; a host with devices is left to the VM tests.
#[test]
fn rdma_node_on_this_host_fails_clearly_without_a_device() {
    let (info, _) = phalanx(&["info"], false);
    let text = String::from_utf8_lossy(&info.stdout).into_owned();
    assert!(info.status.success(), "{text}");
    if !text.contains("RDMA devices: none") {
        println!("this host has RDMA devices: nothing to check here\n{text}");
        return;
    }
    let no_lib = text.contains(NOT_FOUND);
    let cfg = rdma_config();
    let (out, took) = phalanx(&["node", "--config", cfg.as_str(), "--id", "0"], false);
    let lines = stderr_lines(&out);
    println!("{took:?}: {lines:?}");
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let want = if no_lib {
        NOT_FOUND
    } else {
        "no RDMA device found"
    };
    assert!(lines[0].contains(want), "{lines:?}");
    let (info, _) = phalanx(&["info", "--config", cfg.as_str()], false);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(info.status.success());
    assert!(text.contains("transport: rdma"), "{text}");
    assert!(
        text.contains(&format!("verbs: cannot start: {want}")),
        "{text}"
    );
}

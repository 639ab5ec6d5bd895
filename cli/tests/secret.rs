//! The cluster secret across processes: `phalanx secret` makes one, a node without any
//! secret refuses to start (unless `insecure = true`), and a node with another secret cannot
//! join: its start fails with a clear error while the rightful node is admitted.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn phalanx() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_phalanx"));
    c.env_remove("PHALANX_SECRET").env("RUST_LOG", "error");
    c
}

fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// A 2-node config on free loopback ports with `extra` lines on top, in its own file.
fn config(tag: &str, extra: &str) -> std::path::PathBuf {
    let mut toml = format!("transport = \"tcp\"\narena_size = 67108864\n{extra}\n");
    for (id, port) in free_ports(2).into_iter().enumerate() {
        toml += &format!("[[nodes]]\nid = {id}\naddr = \"127.0.0.1:{port}\"\n");
    }
    let p = std::env::temp_dir().join(format!("phalanx-secret-{}-{tag}.toml", std::process::id()));
    std::fs::write(&p, toml).unwrap();
    p
}

fn node(cfg: &std::path::Path, id: u32, secret: Option<&str>) -> Command {
    let mut c = phalanx();
    c.args([
        "node",
        "--config",
        cfg.to_str().unwrap(),
        "--id",
        &id.to_string(),
    ]);
    c.args(["--exit-on-stdin-eof"]);
    if let Some(s) = secret {
        c.env("PHALANX_SECRET", s);
    }
    c.stdin(Stdio::piped());
    c
}

fn finish(mut child: Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return child.wait_with_output().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().unwrap()
}

#[test]
fn phalanx_secret_prints_a_fresh_secret() {
    let a = phalanx().arg("secret").output().unwrap();
    let b = phalanx().arg("secret").output().unwrap();
    assert!(a.status.success());
    let (a, b) = (
        String::from_utf8(a.stdout).unwrap(),
        String::from_utf8(b.stdout).unwrap(),
    );
    assert_eq!(a.trim().len(), 64, "{a}");
    assert!(a.trim().bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
}

#[test]
fn a_node_without_a_secret_refuses_to_start() {
    let cfg = config("none", "");
    let mut cmd = node(&cfg, 0, None);
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let out = finish(child.unwrap(), Duration::from_secs(10));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no cluster secret"), "{err}");
    assert!(err.contains("phalanx secret"), "{err}");
    let _ = std::fs::remove_file(cfg);
}

#[test]
fn a_node_with_another_secret_cannot_join() {
    let cfg = config("other", "");
    let right = "the right secret for this test cluster";
    let mut n0 = node(&cfg, 0, Some(right))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Node 1 dials node 0 with another secret: refused for good, its start fails.
    let stranger = node(&cfg, 1, Some("another secret, not this cluster's"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = finish(stranger, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("cluster secret"), "{err}");
    // The rightful node 1 is admitted: both report up.
    let n1 = node(&cfg, 1, Some(right))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let up = |c: &mut Child| {
        use std::io::BufRead;
        let out = c.stdout.take().unwrap();
        let line = std::io::BufReader::new(out).lines().next();
        assert!(
            matches!(&line, Some(Ok(l)) if l.contains("\"up\"")),
            "{line:?}"
        );
    };
    let mut n1 = n1;
    up(&mut n0);
    up(&mut n1);
    for c in [n0, n1] {
        let mut c = c;
        drop(c.stdin.take());
        let _ = finish(c, Duration::from_secs(10));
    }
    let _ = std::fs::remove_file(cfg);
}

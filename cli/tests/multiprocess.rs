//! Separate OS processes on loopback: a broadcast survives a real SIGKILL of an inner node,
//! and the killed node, restarted, rejoins and completes its get.

use phalanx::ObjectId;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const NODES: u32 = 5;

struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(config: &std::path::Path, id: u32, args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_phalanx"))
            .args([
                "node",
                "--config",
                config.to_str().unwrap(),
                "--id",
                &id.to_string(),
                "--exit-on-stdin-eof",
            ])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn phalanx node");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        Proc { child, lines }
    }

    /// The next line containing `what`, or None on EOF/timeout.
    fn wait_for(&self, what: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(what) => return Some(l),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }

    fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_ports(n: u32) -> Vec<u16> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

fn write_config(dir: &std::path::Path) -> std::path::PathBuf {
    // The secret in a file next to the config (a relative `secret_file`).
    std::fs::write(
        dir.join("cluster.secret"),
        "a fresh secret for the multiprocess test\n",
    )
    .unwrap();
    let mut toml = String::from(
        "transport = \"tcp\"\narena_size = 536870912\nheartbeat_ms = 1000\nsecret_file = \"cluster.secret\"\n",
    );
    for (id, port) in free_ports(NODES).into_iter().enumerate() {
        toml += &format!("[[nodes]]\nid = {id}\naddr = \"127.0.0.1:{port}\"\n");
    }
    let path = dir.join("cluster.toml");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(toml.as_bytes())
        .unwrap();
    path
}

/// Runs one broadcast of 64 MiB from node 0; returns each receiver's get time (None: no
/// result) and the victim's exit status if it was killed.
fn run(tag: &str, fault: bool) -> (Vec<Option<f64>>, Option<i32>, Duration) {
    let dir = std::env::temp_dir().join(format!("phalanx-mp-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = write_config(&dir);
    // The object's directory shard must outlive the victim (node 1).
    let name = (0..)
        .map(|i| format!("mp-{tag}-{i}"))
        .find(|n| ObjectId::new(n.as_str()).stable_hash() % NODES as u64 == 4)
        .unwrap();
    let put = format!("{name}=64M");
    let t0 = Instant::now();
    let mut procs = vec![Proc::spawn(&cfg, 0, &["--put", &put])];
    // Node 1 gets first and then serves a later receiver while still partial.
    let mut victim_args = vec!["--get", name.as_str()];
    if fault {
        victim_args.extend([
            "--fault-object",
            name.as_str(),
            "--fault-after-bytes",
            "16777216",
        ]);
    }
    procs.push(Proc::spawn(&cfg, 1, &victim_args));
    for k in 2..NODES {
        procs.push(Proc::spawn(
            &cfg,
            k,
            &["--get", &name, "--get-delay-ms", "25"],
        ));
    }
    let mut times = vec![None; NODES as usize];
    for (k, p) in procs.iter().enumerate().skip(1) {
        if let Some(l) = p.wait_for("\"got\"", Duration::from_secs(90)) {
            let v: serde_json::Value = serde_json::from_str(&l).unwrap();
            assert_eq!(v["ok"], true, "node {k}: {l}");
            times[k] = v["seconds"].as_f64();
        }
    }
    let wall = t0.elapsed();
    let mut victim_signal = None;
    if fault {
        let status = procs[1].child.wait().unwrap();
        victim_signal = status.signal();
        // Rejoin: node 1 restarts as a new process and completes its get.
        let again = Proc::spawn(&cfg, 1, &["--rejoin", "--get", &name]);
        let l = again
            .wait_for("\"got\"", Duration::from_secs(90))
            .expect("rejoined node finished its get");
        assert!(l.contains("\"ok\":true"), "{l}");
        again.stop();
    }
    for p in procs {
        p.stop();
    }
    let _ = std::fs::remove_dir_all(&dir);
    (times, victim_signal, wall)
}

#[test]
fn broadcast_survives_sigkill_of_an_inner_node_and_the_node_rejoins() {
    let (base, _, base_wall) = run("base", false);
    assert!(
        base.iter().skip(1).all(|t| t.is_some()),
        "baseline: {base:?}"
    );
    let (with_fault, signal, fault_wall) = run("fault", true);
    assert_eq!(
        signal,
        Some(9),
        "the victim died by SIGKILL at the chosen offset"
    );
    for k in 2..NODES as usize {
        assert!(
            with_fault[k].is_some(),
            "live receiver {k} did not finish: {with_fault:?}"
        );
    }
    let slowest = |t: &[Option<f64>]| t.iter().skip(2).flatten().cloned().fold(0.0, f64::max);
    println!(
        "slowest live receiver: {:.1} ms without failure, {:.1} ms with node 1 SIGKILLed mid-transfer (whole runs {:?} vs {:?})",
        slowest(&base) * 1e3,
        slowest(&with_fault) * 1e3,
        base_wall,
        fault_wall
    );
}

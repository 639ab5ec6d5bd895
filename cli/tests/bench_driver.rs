//! `phalanx bench --driver`: rank 0 coordinates a reduce or an allreduce holding no input of
//! its own (a driver, as in a task system). The allreduce is sized from the directory and
//! partitioned like one whose coordinator holds an input, every rank's result is checked
//! against the inputs of ranks 1.., and the flag is refused where it means nothing. Also
//! `--inputs written` (inputs in the stores before the barrier).

use std::process::Command;

fn phalanx() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_phalanx"));
    c.env("RUST_LOG", "error");
    c
}

/// The standard output of `phalanx bench ARGS`, which must succeed.
fn bench(args: &[&str]) -> String {
    let out = phalanx().arg("bench").args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The JSON record of `collective` in a bench's standard output.
fn record<'a>(stdout: &'a str, collective: &str) -> &'a str {
    let tag = format!("\"collective\":\"{collective}\"");
    stdout
        .lines()
        .find(|l| l.starts_with('{') && l.contains(&tag))
        .unwrap_or_else(|| panic!("no {collective} record in:\n{stdout}"))
}

#[test]
fn a_drivers_allreduce_is_partitioned_and_its_reduce_and_gather_checked() {
    let stdout = bench(&[
        "allreduce,reduce,gather",
        "--local",
        "3",
        "--driver",
        "--size",
        "4M",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
    ]);
    let allreduce = record(&stdout, "allreduce");
    assert!(allreduce.contains("\"driver\":true"), "{allreduce}");
    // Two inputs (ranks 1 and 2), one partition each: sized from the directory.
    assert!(allreduce.contains("\"partitions\":2"), "{allreduce}");
    // Every rank's result, and the gathered inputs, checked by the bench itself (it fails
    // otherwise); the records say who held the inputs.
    for collective in ["reduce", "gather"] {
        let r = record(&stdout, collective);
        assert!(r.contains("\"driver\":true"), "{r}");
    }
}

#[test]
fn the_driver_flag_is_refused_where_it_means_nothing() {
    let out = phalanx()
        .args([
            "bench",
            "broadcast",
            "--local",
            "2",
            "--driver",
            "--size",
            "1K",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--driver"), "{stderr}");
}

/// `--inputs written`: every rank writes its input into its store before the barrier and
/// seals it when it is due; the results are checked by the bench as for put inputs (it fails
/// otherwise), with arrivals too, and the records say how the inputs came.
#[test]
fn inputs_written_before_the_barrier_give_checked_results() {
    for interval in ["0", "20"] {
        let stdout = bench(&[
            "allreduce,reduce,gather",
            "--local",
            "3",
            "--inputs",
            "written",
            "--arrival-interval-ms",
            interval,
            "--size",
            "1K,256K,4M",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--json",
        ]);
        for collective in ["allreduce", "reduce", "gather"] {
            let r = record(&stdout, collective);
            assert!(r.contains("\"inputs\":\"written\""), "{r}");
        }
    }
}

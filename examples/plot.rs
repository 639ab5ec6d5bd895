//! Renders the SVG plots of a bench results file, as `phalanx plot` does:
//! `cargo run --release --example plot -- RESULTS [OUT_DIR]` (default OUT_DIR: the results'
//! directory).

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let results = std::path::PathBuf::from(
        args.next()
            .ok_or_else(|| anyhow::anyhow!("usage: plot RESULTS [OUT_DIR]"))?,
    );
    let out = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            results
                .parent()
                .map(|p| p.to_path_buf())
                .unwrap_or_else(|| ".".into())
        });
    for f in phalanx::plot::plot(&results, &out)? {
        println!("{}", f.display());
    }
    Ok(())
}

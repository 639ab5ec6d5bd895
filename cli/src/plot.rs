//! Plots of `phalanx bench --json` results (behind `phalanx plot RESULTS`).
//!
//! The input holds one JSON record per line, as the bench prints them (several runs may be
//! appended to one file; blank lines and lines starting with `#` are skipped). For every
//! collective (and cluster size and transport) it draws median latency against message size on
//! log-log axes, one line per algorithm — for reduce and allreduce one per tree degree too —
//! with the min..max range of each point as a bar. Where records of one size were taken at
//! several arrival intervals, it also draws latency against the interval; where records of
//! one collective were taken at several cluster sizes (`bench --local N`), latency against
//! the number of nodes, one line per size, and from the bench's per-node scale records
//! (`scale_node`, `scale_process`) peak threads and peak memory per node against it. Files
//! are SVG.
//!
//! Series: `star`, `phalanx` and, for reduce/allreduce, `phalanx d=K`. A record may carry
//! `degree_requested` ("auto", "n" or a number); without it the degree the run used names the
//! series. When a series has several records of one size (a run appended twice), the last one
//! in the file is drawn.

use anyhow::{bail, Context, Result};
use plotters::coord::combinators::BindKeyPoints;
use plotters::prelude::*;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The fields of a bench record that the plots use.
#[derive(Debug, Clone, Deserialize)]
pub struct PlotRecord {
    pub collective: String,
    pub algo: String,
    #[serde(default)]
    pub transport: Option<String>,
    #[serde(default)]
    pub nodes: Option<u32>,
    pub size_bytes: u64,
    pub median_s: f64,
    #[serde(default)]
    pub min_s: Option<f64>,
    #[serde(default)]
    pub max_s: Option<f64>,
    #[serde(default)]
    pub arrival_interval_ms: Option<u64>,
    #[serde(default)]
    pub degree: Option<usize>,
    #[serde(default)]
    pub degree_requested: Option<serde_json::Value>,
}

impl PlotRecord {
    /// The line this record belongs to.
    pub fn series(&self) -> String {
        let tree = matches!(self.collective.as_str(), "reduce" | "allreduce");
        if !tree || self.algo != "phalanx" {
            return self.algo.clone();
        }
        let requested = match &self.degree_requested {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            _ => None,
        };
        match (requested.as_deref(), self.degree) {
            (Some("auto"), _) => "phalanx".into(),
            (Some(d), _) => format!("phalanx d={d}"),
            (None, Some(d)) => format!("phalanx d={d}"),
            (None, None) => "phalanx".into(),
        }
    }

    fn group(&self) -> String {
        format!(
            "{}-{}n-{}",
            self.collective,
            self.nodes.map_or("?".into(), |n| n.to_string()),
            self.transport.as_deref().unwrap_or("tcp")
        )
    }
}

/// Reads JSON-lines records; `#` comments, blank lines and the bench's other records (scale
/// and membership figures: objects without a `collective`) are skipped.
pub fn read_records(path: &Path) -> Result<Vec<PlotRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || !is_bench_record(line) {
            continue;
        }
        let r: PlotRecord = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a bench record", path.display(), i + 1))?;
        if !(r.median_s > 0.0 && r.median_s.is_finite()) || r.size_bytes == 0 {
            bail!(
                "{}:{}: a record needs size_bytes > 0 and median_s > 0",
                path.display(),
                i + 1
            );
        }
        out.push(r);
    }
    Ok(out)
}

/// Renders the plots of `results` into `out_dir` (created if missing); returns the files.
pub fn plot(results: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let records = read_records(results)?;
    if records.is_empty() {
        bail!("{}: no bench records", results.display());
    }
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let stem = results
        .file_stem()
        .map_or("results".into(), |s| s.to_string_lossy().into_owned());
    let mut written = Vec::new();

    // Latency against size: records without an arrival interval (or with 0).
    let mut by_group: BTreeMap<String, Vec<&PlotRecord>> = BTreeMap::new();
    for r in &records {
        if r.arrival_interval_ms.unwrap_or(0) == 0 {
            by_group.entry(r.group()).or_default().push(r);
        }
    }
    for (group, recs) in &by_group {
        let series = collect_series(recs, |r| r.size_bytes as f64);
        let path = out_dir.join(format!("{stem}-{group}-latency-vs-size.svg"));
        let (collective, nodes, transport) = describe(recs[0]);
        let title = format!("{stem}: {collective}, {nodes} nodes over {transport}");
        draw(&path, &title, &series, Axis::Size)?;
        written.push(path);
    }

    // Latency against arrival interval: one plot per group and size with 2+ intervals.
    let mut by_size: BTreeMap<(String, u64), Vec<&PlotRecord>> = BTreeMap::new();
    for r in &records {
        if r.arrival_interval_ms.is_some() {
            by_size
                .entry((r.group(), r.size_bytes))
                .or_default()
                .push(r);
        }
    }
    for ((group, size), recs) in &by_size {
        let mut intervals: Vec<u64> = recs.iter().filter_map(|r| r.arrival_interval_ms).collect();
        intervals.sort_unstable();
        intervals.dedup();
        if intervals.len() < 2 {
            continue;
        }
        let series = collect_series(recs, |r| r.arrival_interval_ms.unwrap_or(0) as f64);
        let path = out_dir.join(format!(
            "{stem}-{group}-{}-latency-vs-interval.svg",
            fmt_bytes(*size as f64).replace(' ', "")
        ));
        let (collective, nodes, transport) = describe(recs[0]);
        let title = format!(
            "{stem}: {collective} of {}, {nodes} nodes over {transport}",
            fmt_bytes(*size as f64)
        );
        draw(&path, &title, &series, Axis::Interval)?;
        written.push(path);
    }
    written.extend(plot_vs_nodes(&records, results, out_dir, &stem)?);
    Ok(written)
}

/// Whether a JSON line is a bench record (has a `collective`); a line that is not JSON counts
/// as one, so that its error is reported.
fn is_bench_record(line: &str) -> bool {
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(serde_json::Value::Object(m)) => m.contains_key("collective"),
        _ => true,
    }
}

/// Per cluster size: peak threads of each node, and per largest object size of a run the
/// process's peak RSS per node.
#[derive(Default)]
struct ScaleFigures {
    threads: BTreeMap<u32, Vec<f64>>,
    rss_per_node: BTreeMap<u64, BTreeMap<u32, f64>>,
}

fn read_scale(path: &Path) -> Result<ScaleFigures> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut f = ScaleFigures::default();
    for line in text.lines().map(str::trim) {
        let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(line)
        else {
            continue;
        };
        let Some(n) = m.get("nodes").and_then(|v| v.as_u64()) else {
            continue;
        };
        if m.contains_key("scale_node") {
            if let Some(t) = m.get("peak_threads").and_then(|v| v.as_f64()) {
                f.threads.entry(n as u32).or_default().push(t);
            }
        } else if m.contains_key("scale_process") {
            if let Some(b) = m.get("peak_rss_per_node_bytes").and_then(|v| v.as_f64()) {
                let size = m
                    .get("largest_size_bytes")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(0);
                // Several runs of one kind at one cluster size: the largest.
                let e = f
                    .rss_per_node
                    .entry(size)
                    .or_default()
                    .entry(n as u32)
                    .or_insert(0.0);
                *e = e.max(b);
            }
        }
    }
    Ok(f)
}

/// Latency against the number of nodes (collectives measured at 2+ cluster sizes), and the
/// scale figures against it.
fn plot_vs_nodes(
    records: &[PlotRecord],
    results: &Path,
    out_dir: &Path,
    stem: &str,
) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut by_coll: BTreeMap<(String, String), Vec<&PlotRecord>> = BTreeMap::new();
    for r in records {
        if r.arrival_interval_ms.unwrap_or(0) == 0 && r.nodes.is_some() {
            let t = r.transport.clone().unwrap_or_else(|| "tcp".into());
            by_coll
                .entry((r.collective.clone(), t))
                .or_default()
                .push(r);
        }
    }
    for ((collective, transport), recs) in &by_coll {
        let mut ns: Vec<u32> = recs.iter().filter_map(|r| r.nodes).collect();
        ns.sort_unstable();
        ns.dedup();
        if ns.len() < 2 {
            continue;
        }
        let mut series: BTreeMap<String, BTreeMap<u32, Point>> = BTreeMap::new();
        for r in recs {
            let n = r.nodes.unwrap_or(0);
            let name = format!("{} {}", r.algo, fmt_bytes(r.size_bytes as f64));
            let p = (
                n as f64,
                r.median_s,
                r.min_s.unwrap_or(r.median_s).min(r.median_s),
                r.max_s.unwrap_or(r.median_s).max(r.median_s),
            );
            series.entry(name).or_default().insert(n, p);
        }
        let series: BTreeMap<String, Vec<Point>> = series
            .into_iter()
            .map(|(k, v)| (k, v.into_values().collect()))
            .collect();
        let path = out_dir.join(format!(
            "{stem}-{collective}-{transport}-latency-vs-nodes.svg"
        ));
        let title = format!("{stem}: {collective} over {transport}, one process");
        draw_vs_nodes(&path, &title, "median latency", &series, true, &|y| {
            fmt_secs(y)
        })?;
        written.push(path);
    }
    let scale = read_scale(results)?;
    if scale.threads.len() >= 2 {
        let mut series: BTreeMap<String, Vec<Point>> = BTreeMap::new();
        for (&n, ts) in &scale.threads {
            let mut ts = ts.clone();
            ts.sort_by(f64::total_cmp);
            let (lo, mid, hi) = (ts[0], ts[ts.len() / 2], ts[ts.len() - 1]);
            let x = n as f64;
            series
                .entry("peak threads per node (median; bar: min..max)".into())
                .or_default()
                .push((x, mid, lo, hi));
        }
        let path = out_dir.join(format!("{stem}-threads-vs-nodes.svg"));
        let title = format!("{stem}: peak threads per node");
        draw_vs_nodes(&path, &title, "threads", &series, false, &|y| {
            format!("{y:.0}")
        })?;
        written.push(path);
    }
    if scale.rss_per_node.values().any(|m| m.len() >= 2) {
        let series: BTreeMap<String, Vec<Point>> = scale
            .rss_per_node
            .iter()
            .map(|(&size, by_n)| {
                let name = match size {
                    0 => "peak RSS of the process / nodes".to_string(),
                    s => format!("peak RSS / nodes, objects of {}", fmt_bytes(s as f64)),
                };
                let pts = by_n.iter().map(|(&n, &b)| (n as f64, b, b, b)).collect();
                (name, pts)
            })
            .collect();
        let path = out_dir.join(format!("{stem}-memory-vs-nodes.svg"));
        let title = format!("{stem}: peak memory per node");
        draw_vs_nodes(&path, &title, "bytes per node", &series, true, &|y| {
            fmt_bytes(y)
        })?;
        written.push(path);
    }
    Ok(written)
}

/// A line chart against the number of nodes (log 2 axis labelled with the sizes measured).
fn draw_vs_nodes(
    path: &Path,
    title: &str,
    ydesc: &str,
    series: &BTreeMap<String, Vec<Point>>,
    log_y: bool,
    ylabel: &dyn Fn(f64) -> String,
) -> Result<()> {
    let (x0, x1, y0, y1) = extent(series);
    let xs = measured_xs(series);
    let names: Vec<&String> = series.keys().collect();
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 20))
        .margin(18)
        .x_label_area_size(48)
        .y_label_area_size(78);
    let x = (x0 / 1.3..x1 * 1.3).log_scale().with_key_points(xs);
    // Log y either way (draw_lines' axis); counts (threads) from 1, so that small integers
    // are not squeezed against the top.
    let (ylo, yhi) = if log_y {
        (y0 / 1.6, y1 * 1.6)
    } else {
        (1.0, (y1 * 1.3).max(2.0))
    };
    let mut chart = b
        .build_cartesian_2d(x, (ylo..yhi).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("nodes")
        .y_desc(ydesc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| ylabel(*y))
        .light_line_style(RGBColor(235, 235, 235))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    draw_lines(&mut chart, &names, series)?;
    root.present().map_err(err)?;
    Ok(())
}

fn describe(r: &PlotRecord) -> (String, String, String) {
    (
        r.collective.clone(),
        r.nodes.map_or("?".into(), |n| n.to_string()),
        r.transport.clone().unwrap_or_else(|| "tcp".into()),
    )
}

/// A point: x, median, min, max.
type Point = (f64, f64, f64, f64);

/// Series name -> points sorted by x; the last record of a given x wins.
fn collect_series(
    recs: &[&PlotRecord],
    x_of: impl Fn(&PlotRecord) -> f64,
) -> BTreeMap<String, Vec<Point>> {
    let mut m: BTreeMap<String, BTreeMap<u64, Point>> = BTreeMap::new();
    for r in recs {
        let x = x_of(r);
        let p = (
            x,
            r.median_s,
            r.min_s.unwrap_or(r.median_s).min(r.median_s),
            r.max_s.unwrap_or(r.median_s).max(r.median_s),
        );
        m.entry(r.series()).or_default().insert(x.to_bits(), p);
    }
    m.into_iter()
        .map(|(k, v)| {
            let mut pts: Vec<Point> = v.into_values().collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (k, pts)
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Axis {
    Size,
    Interval,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// Phalanx's own lines first, then the baselines, each keeping its colour across plots.
fn color_of(name: &str, index: usize) -> RGBColor {
    match name {
        "phalanx" => COLORS[0],
        "star" => COLORS[1],
        _ => COLORS[2 + index % (COLORS.len() - 2)],
    }
}

/// The smallest and largest x, and the lowest and highest y (whiskers included).
fn extent(series: &BTreeMap<String, Vec<Point>>) -> (f64, f64, f64, f64) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, _, lo, hi) in series.values().flatten() {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(lo);
        y1 = y1.max(hi);
    }
    (x0, x1, y0, y1)
}

/// The x values measured, sorted and once each (the axis labels them, not powers of ten).
fn measured_xs(series: &BTreeMap<String, Vec<Point>>) -> Vec<f64> {
    let mut xs: Vec<f64> = series.values().flatten().map(|q| q.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs
}

fn draw(path: &Path, title: &str, series: &BTreeMap<String, Vec<Point>>, axis: Axis) -> Result<()> {
    let (x0, x1, y0, y1) = extent(series);
    // Pad the ranges so the end points are not on the frame.
    let (y0, y1) = (y0 / 1.6, y1 * 1.6);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 20))
        .margin(18)
        .x_label_area_size(48)
        .y_label_area_size(78);
    let ylabel = |y: &f64| fmt_secs(*y);
    let mut names: Vec<&String> = series.keys().collect();
    // "phalanx" first, then its degree variants, then the baselines.
    names.sort_by_key(|n| (!n.starts_with("phalanx"), n.len() > 7, n.to_string()));
    match axis {
        Axis::Size => {
            let (x0, x1) = (x0 / 1.6, x1 * 1.6);
            // Label the measured sizes themselves (1 KiB, 64 KiB, ...), not powers of ten.
            let xs = measured_xs(series);
            let mut chart = b
                .build_cartesian_2d(
                    (x0..x1).log_scale().with_key_points(xs),
                    (y0..y1).log_scale(),
                )
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("message size")
                .y_desc("median latency")
                .x_label_formatter(&|x| fmt_bytes(*x))
                .y_label_formatter(&ylabel)
                .light_line_style(RGBColor(235, 235, 235))
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 15))
                .draw()
                .map_err(err)?;
            draw_lines(&mut chart, &names, series)?;
        }
        Axis::Interval => {
            let pad = ((x1 - x0) * 0.05).max(0.5);
            let mut chart = b
                .build_cartesian_2d((x0 - pad)..(x1 + pad), (y0..y1).log_scale())
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("arrival interval between ranks (ms)")
                .y_desc("median latency")
                .y_label_formatter(&ylabel)
                .light_line_style(RGBColor(235, 235, 235))
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 15))
                .draw()
                .map_err(err)?;
            draw_lines(&mut chart, &names, series)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// One line per name (points, min..max whiskers) and the legend, on either kind of x axis.
fn draw_lines<'a, DB, X>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, LogCoord<f64>>>,
    names: &[&String],
    series: &BTreeMap<String, Vec<Point>>,
) -> Result<()>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
{
    for (i, name) in names.iter().enumerate() {
        let c = color_of(name, i);
        let p = &series[*name];
        chart
            .draw_series(LineSeries::new(
                p.iter().map(|q| (q.0, q.1)),
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], c.stroke_width(2)));
        chart
            .draw_series(p.iter().map(|q| Circle::new((q.0, q.1), 3, c.filled())))
            .map_err(err)?;
        chart
            .draw_series(
                p.iter()
                    .filter(|q| q.3 > q.2)
                    .map(|q| PathElement::new(vec![(q.0, q.2), (q.0, q.3)], c.stroke_width(1))),
            )
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    Ok(())
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the plot: {e:?}")
}

/// 1536 -> "1.5 KiB", 1048576 -> "1 MiB".
pub fn fmt_bytes(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    trim(v, units[u])
}

/// 0.0012 -> "1.2 ms".
pub fn fmt_secs(s: f64) -> String {
    let (v, u) = if s >= 1.0 {
        (s, "s")
    } else if s >= 1e-3 {
        (s * 1e3, "ms")
    } else if s >= 1e-6 {
        (s * 1e6, "µs")
    } else {
        (s * 1e9, "ns")
    };
    trim(v, u)
}

fn trim(v: f64, unit: &str) -> String {
    let s = if v >= 100.0 || (v - v.round()).abs() < 0.05 {
        format!("{:.0}", v)
    } else if v >= 10.0 {
        format!("{:.1}", v)
    } else {
        format!("{:.2}", v)
    };
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(collective: &str, algo: &str, size: u64, med: f64, extra: &str) -> String {
        format!(
            r#"{{"collective":"{collective}","algo":"{algo}","transport":"tcp","nodes":8,"size_bytes":{size},"iters":5,"median_s":{med},"min_s":{},"max_s":{},"throughput_gbit_s":1.0{extra}}}"#,
            med * 0.9,
            med * 1.2
        )
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_bytes(1024.0), "1 KiB");
        assert_eq!(fmt_bytes(64.0 * 1024.0 * 1024.0), "64 MiB");
        assert_eq!(fmt_bytes(1536.0), "1.5 KiB");
        assert_eq!(fmt_secs(0.5615), "562 ms");
        assert_eq!(fmt_secs(2.0), "2 s");
        assert_eq!(fmt_secs(0.0000123), "12.3 µs");
    }

    #[test]
    fn series_names() {
        let r: PlotRecord =
            serde_json::from_str(&rec("reduce", "phalanx", 1024, 0.001, r#","degree":2"#)).unwrap();
        assert_eq!(r.series(), "phalanx d=2");
        let r: PlotRecord = serde_json::from_str(&rec(
            "reduce",
            "phalanx",
            1024,
            0.001,
            r#","degree":2,"degree_requested":"auto""#,
        ))
        .unwrap();
        assert_eq!(r.series(), "phalanx");
        let r: PlotRecord =
            serde_json::from_str(&rec("broadcast", "star", 1024, 0.001, "")).unwrap();
        assert_eq!(r.series(), "star");
    }

    #[test]
    fn renders_size_and_interval_plots() {
        let dir = std::env::temp_dir().join(format!("phalanx-plot-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let results = dir.join("res.jsonl");
        let mut lines = vec!["# a comment".to_string(), String::new()];
        for (i, size) in [1u64 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
            .iter()
            .enumerate()
        {
            let t = 1e-4 + *size as f64 / 1.2e8;
            lines.push(rec("broadcast", "phalanx", *size, t, ""));
            lines.push(rec("broadcast", "star", *size, t * 7.0, ""));
            let ai = r#","arrival_interval_ms":0,"degree":1"#;
            lines.push(rec("reduce", "phalanx", *size, t * 1.1, ai));
            let an = r#","arrival_interval_ms":0,"degree":7"#;
            lines.push(rec(
                "reduce",
                "phalanx",
                *size,
                t * 3.0 + i as f64 * 1e-3,
                an,
            ));
        }
        for ms in [0u64, 5, 10, 20] {
            let x = format!(r#","arrival_interval_ms":{ms},"degree":2"#);
            lines.push(rec(
                "reduce",
                "phalanx",
                1 << 20,
                0.02 + ms as f64 * 7e-3,
                &x,
            ));
            lines.push(rec("reduce", "star", 1 << 20, 0.06 + ms as f64 * 7e-3, &x));
        }
        std::fs::write(&results, lines.join("\n")).unwrap();
        let out = dir.join("plots");
        let files = plot(&results, &out).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
        assert!(names.contains(&"res-broadcast-8n-tcp-latency-vs-size.svg".to_string()));
        assert!(names.contains(&"res-reduce-8n-tcp-latency-vs-size.svg".to_string()));
        assert!(names.contains(&"res-reduce-8n-tcp-1MiB-latency-vs-interval.svg".to_string()));
        for f in &files {
            let svg = std::fs::read_to_string(f).unwrap();
            assert!(svg.starts_with("<svg"), "{}", f.display());
            assert!(svg.contains("</svg>"));
        }
        let bc =
            std::fs::read_to_string(out.join("res-broadcast-8n-tcp-latency-vs-size.svg")).unwrap();
        assert!(bc.contains("star") && bc.contains("phalanx"));
        assert!(bc.contains("64 MiB") && bc.contains("1 KiB"), "size labels");
        let rd =
            std::fs::read_to_string(out.join("res-reduce-8n-tcp-latency-vs-size.svg")).unwrap();
        assert!(rd.contains("phalanx d=1") && rd.contains("phalanx d=7"));

        // Broken input is reported with its line number.
        std::fs::write(&results, "{\"collective\":\"broadcast\"}\n").unwrap();
        let e = plot(&results, &out).unwrap_err();
        assert!(format!("{e:#}").contains(":1:"), "{e:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn renders_plots_against_the_number_of_nodes() {
        let dir =
            std::env::temp_dir().join(format!("phalanx-plot-nodes-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let results = dir.join("scale.jsonl");
        let mut lines = Vec::new();
        for n in [8u32, 16, 64] {
            for (size, t) in [(1u64 << 20, 0.003), (64 << 20, 0.2)] {
                let r = rec("broadcast", "phalanx", size, t * n as f64 / 8.0, "")
                    .replace(r#""nodes":8"#, &format!(r#""nodes":{n}"#));
                lines.push(r);
            }
            for k in 0..n {
                lines.push(format!(
                    r#"{{"scale_node":{k},"nodes":{n},"peak_threads":{},"links_peak":3}}"#,
                    10 + k % 4
                ));
            }
            lines.push(format!(
                r#"{{"scale_process":true,"nodes":{n},"peak_rss_bytes":1,"peak_rss_per_node_bytes":{}}}"#,
                (6u64 << 20) + n as u64
            ));
        }
        std::fs::write(&results, lines.join("\n")).unwrap();
        let out = dir.join("plots");
        let files = plot(&results, &out).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for want in [
            "scale-broadcast-tcp-latency-vs-nodes.svg",
            "scale-threads-vs-nodes.svg",
            "scale-memory-vs-nodes.svg",
        ] {
            assert!(names.contains(&want.to_string()), "{want} in {names:?}");
        }
        let lat = std::fs::read_to_string(out.join("scale-broadcast-tcp-latency-vs-nodes.svg"))
            .unwrap()
            .replace('\n', "");
        assert!(lat.contains("phalanx 1 MiB") && lat.contains("phalanx 64 MiB"));
        assert!(
            lat.contains(">64</text>") && lat.contains(">8</text>"),
            "node counts labelled"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

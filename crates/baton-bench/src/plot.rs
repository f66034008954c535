//! Plots of a report, PNG and SVG from the same drawing code: latency CDFs (TTFT, ITL, JCT),
//! the number of requests in flight over time, and for a sweep over rates TTFT, TBT and
//! throughput (or goodput) against the rate; and several reports' sweeps in one figure ([`write_versus`]).
//!
//! Text is drawn with an embedded DejaVu Sans (through `ab_glyph`), so plotting needs no system
//! fonts or fontconfig.

use std::path::{Path, PathBuf};
use std::sync::Once;

use baton_measure::cdf_points;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::BenchError;
use crate::metrics::{RequestRecord, in_flight};
use crate::report::{Better, Report, SWEEP_FIGURES, sweep_runs};

type Res = Result<(), String>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is compiled in and valid; a failure would only lose the labels.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Writes every plot that applies to `report` into `dir` (created if needed) as PNG and SVG;
/// returns the files written.
pub fn write_plots(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    register_font();
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Io { path: dir.to_path_buf(), source })?;
    let mut written = Vec::new();
    Canvas::Cdf(report).write(dir, "latency_cdf", (1500, 460), &mut written)?;
    Canvas::Timeline(report).write(dir, "in_flight", (1000, 460), &mut written)?;
    if sweep_runs(report).len() >= 2 {
        Canvas::Sweep(report).write(dir, "sweep", (1500, 460), &mut written)?;
    }
    Ok(written)
}

/// Writes `versus.png` and `versus.svg` into `dir`: the rate sweeps of several named reports
/// (e.g. colocated and disaggregated serving) in one figure, a panel per figure of
/// [`SWEEP_FIGURES`] (TTFT, TBT and JCT p90, goodput) and a line per report. Returns the files.
pub fn write_versus(reports: &[(&str, &Report)], dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    register_font();
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Io { path: dir.to_path_buf(), source })?;
    let mut written = Vec::new();
    Canvas::Versus(reports).write(dir, "versus", (1800, 460), &mut written)?;
    Ok(written)
}

/// One figure, drawable on any backend.
enum Canvas<'a> {
    Cdf(&'a Report),
    Timeline(&'a Report),
    Sweep(&'a Report),
    Versus(&'a [(&'a str, &'a Report)]),
}

impl Canvas<'_> {
    /// Draws `NAME.png` and `NAME.svg` in `dir`.
    fn write(&self, dir: &Path, name: &str, size: (u32, u32), written: &mut Vec<PathBuf>) -> Result<(), BenchError> {
        let png = dir.join(format!("{name}.png"));
        let svg = dir.join(format!("{name}.svg"));
        self.png(&png, size)
            .and_then(|()| self.svg(&svg, size))
            .map_err(|e| BenchError::Plot(format!("{name}: {e}")))?;
        written.extend([png, svg]);
        Ok(())
    }

    fn png(&self, path: &Path, size: (u32, u32)) -> Res {
        let root = BitMapBackend::new(path, size).into_drawing_area();
        self.draw(&root)?;
        root.present().map_err(err)
    }

    fn svg(&self, path: &Path, size: (u32, u32)) -> Res {
        let root = SVGBackend::new(path, size).into_drawing_area();
        self.draw(&root)?;
        root.present().map_err(err)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Res {
        root.fill(&WHITE).map_err(err)?;
        match self {
            Canvas::Cdf(r) => draw_cdfs(root, r),
            Canvas::Timeline(r) => draw_timeline(root, r),
            Canvas::Sweep(r) => draw_sweep(root, r),
            Canvas::Versus(r) => draw_versus(root, r),
        }
    }
}

/// The values of one metric (0: TTFT, 1: ITL, else JCT) over the completed requests, ms, sorted.
fn metric_values(records: &[RequestRecord], metric: usize) -> Vec<f64> {
    let ok = records.iter().filter(|r| r.ok());
    let mut v: Vec<f64> = match metric {
        0 => ok.filter_map(|r| r.ttft_us).map(|t| t as f64 / 1e3).collect(),
        1 => ok.flat_map(|r| r.itl_us.iter()).map(|&t| t as f64 / 1e3).collect(),
        _ => ok.map(|r| r.jct_us as f64 / 1e3).collect(),
    };
    v.sort_by(f64::total_cmp);
    v
}

fn draw_cdfs<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, report: &Report) -> Res {
    let panels = root.split_evenly((1, 3));
    for (m, (panel, title)) in panels.iter().zip(["TTFT", "ITL (time between tokens)", "JCT (end to end)"]).enumerate()
    {
        let series: Vec<(String, Vec<(f64, f64)>)> = report
            .runs
            .iter()
            .map(|run| (run.label.clone(), cdf_points(&metric_values(&run.records, m), 2000)))
            .collect();
        let axes = Axes {
            title: &format!("{title} CDF"),
            x_desc: "ms",
            y_desc: "fraction of requests",
            y_max: Some(1.0),
            legend: SeriesLabelPosition::LowerRight,
            dots: false,
        };
        line_panel(panel, axes, max_x(&series) * 1.05, series)?;
    }
    Ok(())
}

/// The in-flight count as a step line: (seconds, count).
pub fn timeline_points(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    let mut pts = vec![(0.0, 0.0)];
    let mut prev = 0.0;
    for (t, n) in in_flight(records) {
        let x = t as f64 / 1e6;
        pts.push((x, prev));
        pts.push((x, n as f64));
        prev = n as f64;
    }
    pts
}

fn draw_timeline<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, report: &Report) -> Res {
    let series: Vec<(String, Vec<(f64, f64)>)> =
        report.runs.iter().map(|r| (r.label.clone(), timeline_points(&r.records))).collect();
    let y_max = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(0.0f64, f64::max).max(1.0) * 1.1;
    let axes = Axes {
        title: "Requests in flight",
        x_desc: "seconds from the start of the run",
        y_desc: "requests",
        y_max: Some(y_max),
        legend: SeriesLabelPosition::UpperRight,
        dots: false,
    };
    line_panel(root, axes, max_x(&series) * 1.02, series)?;
    Ok(())
}

/// A metric of a summary.
type Pick = fn(&crate::metrics::Summary) -> f64;
/// A panel of the sweep figure: title, unit, and the lines (label, metric).
type Panel = (&'static str, &'static str, Vec<(&'static str, Pick)>);

fn draw_sweep<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, report: &Report) -> Res {
    let pts = sweep_runs(report);
    let xmax = pts.iter().map(|p| p.0).fold(0.0, f64::max) * 1.05;
    let has_slo = pts.iter().any(|p| p.1.slo.is_some());
    let panels: [Panel; 3] = [
        (
            "TTFT vs rate",
            "ms",
            vec![("p50", |s| s.ttft_ms.p50), ("p90", |s| s.ttft_ms.p90), ("p99", |s| s.ttft_ms.p99)],
        ),
        (
            "TBT vs rate",
            "ms",
            vec![("ITL p50", |s| s.itl_ms.p50), ("ITL p90", |s| s.itl_ms.p90), ("TPOT mean", |s| s.tpot_ms.mean)],
        ),
        if has_slo {
            (
                "Goodput vs rate",
                "req/s",
                vec![("goodput", |s| s.slo.map_or(0.0, |x| x.goodput_req_s)), ("completed", |s| s.request_throughput)],
            )
        } else {
            ("Output throughput vs rate", "tok/s", vec![("output tok/s", |s| s.output_throughput)])
        },
    ];
    for (area, (title, unit, lines)) in root.split_evenly((1, 3)).iter().zip(panels) {
        let series: Vec<(&str, Vec<(f64, f64)>)> =
            lines.into_iter().map(|(label, f)| (label, pts.iter().map(|p| (p.0, f(p.1))).collect())).collect();
        rate_panel(area, title, unit, xmax, series)?;
    }
    Ok(())
}

/// A panel against the request rate, its y axis sized to the data.
fn rate_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    unit: &str,
    xmax: f64,
    series: Vec<(&str, Vec<(f64, f64)>)>,
) -> Res {
    let axes = Axes {
        title,
        x_desc: "request rate (req/s)",
        y_desc: unit,
        y_max: None,
        legend: SeriesLabelPosition::UpperLeft,
        dots: true,
    };
    line_panel(area, axes, xmax, series)
}

/// How a [`line_panel`] looks.
struct Axes<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    /// The top of the y axis (`None`: 10% above the largest value).
    y_max: Option<f64>,
    legend: SeriesLabelPosition,
    /// Mark each point with a dot.
    dots: bool,
}

/// The largest x of a set of lines (at least a sliver, so an empty chart still has an axis).
fn max_x<L>(series: &[(L, Vec<(f64, f64)>)]) -> f64 {
    series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(0.0f64, f64::max).max(1e-3)
}

/// The one chart of every figure: lines (label, points) from x = 0 to `x_max`, y from 0, a
/// legend. Every panel of the CDF, timeline, sweep and versus figures is drawn here.
fn line_panel<DB: DrawingBackend, L: Into<String>>(
    area: &DrawingArea<DB, Shift>,
    axes: Axes<'_>,
    x_max: f64,
    series: Vec<(L, Vec<(f64, f64)>)>,
) -> Res {
    let y_max = axes
        .y_max
        .unwrap_or_else(|| series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(0.0, f64::max).max(1e-3) * 1.1);
    let mut chart = ChartBuilder::on(area)
        .caption(axes.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max.max(1e-3), 0.0..y_max)
        .map_err(err)?;
    chart.configure_mesh().x_desc(axes.x_desc).y_desc(axes.y_desc).draw().map_err(err)?;
    for (i, (label, data)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let line = LineSeries::new(data.iter().copied(), color.stroke_width(2));
        chart
            .draw_series(line)
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        if axes.dots {
            chart.draw_series(data.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(axes.legend)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn draw_versus<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, reports: &[(&str, &Report)]) -> Res {
    let runs: Vec<(&str, Vec<(f64, &crate::metrics::Summary)>)> =
        reports.iter().map(|(name, r)| (*name, sweep_runs(r))).collect();
    let xmax = runs.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(0.0, f64::max) * 1.05;
    for (area, fig) in root.split_evenly((1, SWEEP_FIGURES.len())).iter().zip(SWEEP_FIGURES) {
        let series: Vec<(&str, Vec<(f64, f64)>)> = runs
            .iter()
            .map(|(name, pts)| (*name, pts.iter().filter_map(|p| (fig.pick)(p.1).map(|v| (p.0, v))).collect()))
            .collect();
        let better = if fig.better == Better::Higher { "higher is better" } else { "lower is better" };
        rate_panel(area, &format!("{} ({better})", fig.name), fig.unit, xmax, series)?;
    }
    Ok(())
}

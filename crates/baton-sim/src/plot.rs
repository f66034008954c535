//! Plots of simulation reports, as PNG and SVG: CDFs of TTFT and JCT with one line per run,
//! and a summary of bar charts (TTFT mean and p90, SLO attainment, requests completed within the
//! SLOs and rejected, wasted prefill) with one bar per run.
//!
//! Text is drawn with a font shipped as a crate (DejaVu Sans, from `dejavu`) and rasterised by
//! `ab_glyph`, so no system font library (fontconfig, FreeType) is needed.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{IntoSegmentedCoord, SegmentValue};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::Report;
use baton_sched::Micros;

/// A plot could not be drawn or written.
#[derive(Debug, thiserror::Error)]
#[error("plotting {path}: {message}")]
pub struct PlotError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

const FONT: &str = "sans-serif";
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The shipped font parses; if it ever did not, plotters would fail on the first label.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    });
}

/// A run's name in legends: the policy, and the admission control when it is not `none`.
pub fn run_label(r: &Report) -> String {
    if r.admission == "none" { r.policy.clone() } else { format!("{}/{}", r.policy, r.admission) }
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn secs(us: Micros) -> f64 {
    us as f64 / 1e6
}

/// One CDF line per run over `samples(run)` (seconds on x, fraction of completed requests on y).
fn draw_cdf<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    runs: &[Report],
    samples: impl Fn(&Report) -> &[Micros],
) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let xmax = runs.iter().filter_map(|r| samples(r).last()).map(|&v| secs(v)).fold(0.0f64, f64::max).max(1e-3);
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax * 1.02, 0.0..1.0)?;
    chart.configure_mesh().x_desc("seconds").y_desc("fraction of completed requests").label_style((FONT, 14)).draw()?;
    for (i, r) in runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // At most ~2,000 points per line.
        let points: Vec<(f64, f64)> =
            baton_measure::cdf_points(samples(r), 2000).into_iter().map(|(us, f)| (us / 1e6, f)).collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(run_label(r))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    root.present()
}

/// One bar per run.
fn draw_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    labels: &[String],
    values: &[f64],
) -> DrawResult<DB> {
    let n = values.len().max(1);
    let ymax = values.iter().copied().fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 18))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..ymax)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => labels.get(*i).cloned().unwrap_or_default(),
            SegmentValue::Last => String::new(),
        })
        .label_style((FONT, 13))
        .draw()?;
    chart.draw_series(values.iter().enumerate().map(|(i, &v)| {
        let color = COLORS[i % COLORS.len()];
        Rectangle::new([(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), v)], color.filled())
    }))?;
    let above = TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(values.iter().enumerate().map(|(i, &v)| {
        let text = if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.2}") };
        Text::new(text, (SegmentValue::CenterOf(i), v), above.clone())
    }))?;
    Ok(())
}

/// The summary: TTFT mean, TTFT p90, TTFT SLO attainment, completed within both SLOs,
/// rejected (early + after prefill), wasted prefill seconds.
fn draw_summary<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str, runs: &[Report]) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let root = root.titled(title, (FONT, 24))?;
    // Bars are labelled by what differs between the runs (the title says the rest).
    let same = |f: fn(&Report) -> &str| runs.iter().all(|r| f(r) == f(&runs[0]));
    let labels: Vec<String> = runs
        .iter()
        .map(|r| match (same(|r| &r.policy), same(|r| &r.admission)) {
            (true, false) => r.admission.clone(),
            (_, true) => r.policy.clone(),
            (false, false) => run_label(r),
        })
        .collect();
    type Metric = fn(&Report) -> f64;
    let panels: [(&str, Metric); 6] = [
        ("TTFT mean (s)", |r| secs(r.ttft.mean)),
        ("TTFT p90 (s)", |r| secs(r.ttft.p90)),
        ("TTFT SLO attainment", |r| r.ttft_slo_attainment),
        ("completed within both SLOs", |r| r.completed_within_slo as f64),
        ("rejected (early + after prefill)", |r| (r.rejected_early + r.rejected_after_prefill) as f64),
        ("JCT mean (s)", |r| secs(r.jct.mean)),
    ];
    for (area, (name, f)) in root.split_evenly((2, 3)).iter().zip(panels.iter()) {
        let values: Vec<f64> = runs.iter().map(f).collect();
        draw_bars(area, name, &labels, &values)?;
    }
    root.present()
}

/// What to draw.
#[derive(Clone, Copy)]
enum Figure {
    TtftCdf,
    JctCdf,
    Summary,
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    fig: Figure,
    title: &str,
    runs: &[Report],
) -> DrawResult<DB> {
    match fig {
        Figure::TtftCdf => draw_cdf(root, &format!("{title}: TTFT CDF"), runs, |r| &r.ttft_samples_us),
        Figure::JctCdf => draw_cdf(root, &format!("{title}: JCT CDF"), runs, |r| &r.jct_samples_us),
        Figure::Summary => draw_summary(root, title, runs),
    }
}

/// Writes `{stem}_ttft_cdf`, `{stem}_jct_cdf` and `{stem}_summary`, each as `.png` and `.svg`,
/// into `dir` (created if missing), and returns the paths written.
pub fn write_plots(dir: &Path, stem: &str, title: &str, runs: &[Report]) -> Result<Vec<PathBuf>, PlotError> {
    register_font();
    let err = |path: &Path, message: String| PlotError { path: path.display().to_string(), message };
    std::fs::create_dir_all(dir).map_err(|e| err(dir, e.to_string()))?;
    let mut written = Vec::new();
    for (fig, name, size) in [
        (Figure::TtftCdf, "ttft_cdf", (900, 600)),
        (Figure::JctCdf, "jct_cdf", (900, 600)),
        (Figure::Summary, "summary", (1500, 850)),
    ] {
        let png = dir.join(format!("{stem}_{name}.png"));
        {
            let root = BitMapBackend::new(&png, size).into_drawing_area();
            draw(&root, fig, title, runs).map_err(|e| err(&png, e.to_string()))?;
        }
        let svg = dir.join(format!("{stem}_{name}.svg"));
        {
            let root = SVGBackend::new(&svg, size).into_drawing_area();
            draw(&root, fig, title, runs).map_err(|e| err(&svg, e.to_string()))?;
        }
        written.push(png);
        written.push(svg);
    }
    Ok(written)
}

/// The pools' load over time, one panel per run that has a load trace (Mooncake's Figures 7–8):
/// the prefill pool's mean queued prefill time over the TTFT target and the decode pool's mean
/// step over the TBT target; the dashed line is the target, the dotted one admission's limit.
fn draw_load<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str, runs: &[&Report]) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let root = root.titled(title, (FONT, 22))?;
    let n = runs.len().max(1);
    let pools: Vec<Vec<(f64, f64, f64)>> =
        runs.iter().map(|r| r.load_trace.pool_load(r.slo_ttft_us, r.slo_tbt_us)).collect();
    let xmax = pools.iter().filter_map(|p| p.last()).map(|l| l.0).fold(1.0f64, f64::max);
    let ymax = pools.iter().flatten().map(|&(_, p, d)| p.max(d)).fold(1.2f64, f64::max).min(3.0);
    for ((area, r), pool) in root.split_evenly((n, 1)).iter().zip(runs).zip(&pools) {
        let limit = r.load_trace.admissions.first().map(|a| a.limit_us as f64 / r.slo_tbt_us.max(1) as f64);
        let caption = format!(
            "{}: {} within SLOs, {} rejected",
            run_label(r),
            r.completed_within_slo,
            r.rejected_early + r.rejected_after_prefill
        );
        let mut chart = ChartBuilder::on(area)
            .caption(caption, (FONT, 17))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
        chart.configure_mesh().x_desc("virtual time (s)").y_desc("load (1 = SLO)").label_style((FONT, 13)).draw()?;
        let prefill = RGBColor(44, 160, 44);
        let decode = RGBColor(230, 160, 0);
        chart
            .draw_series(LineSeries::new(pool.iter().map(|&(t, p, _)| (t, p.min(ymax))), prefill.stroke_width(1)))?
            .label("prefill pool: queued prefill / TTFT SLO")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], prefill.stroke_width(2)));
        chart
            .draw_series(LineSeries::new(pool.iter().map(|&(t, _, d)| (t, d.min(ymax))), decode.stroke_width(1)))?
            .label("decode pool: step / TBT SLO")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], decode.stroke_width(2)));
        chart.draw_series(DashedLineSeries::new(vec![(0.0, 1.0), (xmax, 1.0)], 6, 4, BLACK.stroke_width(1)))?;
        if let Some(l) = limit {
            chart.draw_series(DashedLineSeries::new(vec![(0.0, l), (xmax, l)], 2, 3, BLACK.stroke_width(1)))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 13))
            .draw()?;
    }
    root.present()
}

/// Writes `{stem}_load` as `.png` and `.svg` into `dir` from the runs that carry a load trace
/// ([`SimConfig::load_trace_us`](crate::SimConfig)), and returns the paths written (none when
/// no run has one).
pub fn write_load_plot(dir: &Path, stem: &str, title: &str, runs: &[Report]) -> Result<Vec<PathBuf>, PlotError> {
    let traced: Vec<&Report> = runs.iter().filter(|r| !r.load_trace.samples.is_empty()).collect();
    if traced.is_empty() {
        return Ok(Vec::new());
    }
    register_font();
    let err = |path: &Path, message: String| PlotError { path: path.display().to_string(), message };
    std::fs::create_dir_all(dir).map_err(|e| err(dir, e.to_string()))?;
    let size = (1400, 120 + 330 * traced.len() as u32);
    let png = dir.join(format!("{stem}_load.png"));
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_load(&root, title, &traced).map_err(|e| err(&png, e.to_string()))?;
    }
    let svg = dir.join(format!("{stem}_load.svg"));
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_load(&root, title, &traced).map_err(|e| err(&svg, e.to_string()))?;
    }
    Ok(vec![png, svg])
}

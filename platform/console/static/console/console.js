// Console behaviour: charts from server-rendered JSON (json_script), copy buttons.
// No inline scripts and nothing from another origin: Chart.js and htmx are vendored static files.
(function () {
  "use strict";

  const COLORS = { blue: "#2563eb", green: "#16a34a", orange: "#ea580c", red: "#dc2626", grey: "#64748b" };

  function line(label, data, color, extra) {
    return Object.assign({ label: label, data: data, borderColor: color, backgroundColor: color + "33",
      borderWidth: 2, pointRadius: 0, tension: 0.25, spanGaps: true }, extra || {});
  }

  const BUILDERS = {
    tokens: (d) => ({ type: "line", data: { labels: d.labels, datasets: [
      line("input tokens/s", d.tokens.input, COLORS.blue, { fill: true }),
      line("output tokens/s", d.tokens.output, COLORS.green, { fill: true }),
    ] } }),
    requests: (d) => ({ type: "bar", data: { labels: d.labels, datasets: [
      { label: "requests", data: d.requests, backgroundColor: COLORS.blue },
      { label: "not ok", data: d.failed, backgroundColor: COLORS.red },
    ] } }),
    ttft: (d) => ({ type: "line", data: { labels: d.labels, datasets: [
      line("p50", d.ttft.p50, COLORS.blue), line("p95", d.ttft.p95, COLORS.orange),
    ] } }),
    decode: (d) => ({ type: "line", data: { labels: d.labels, datasets: [
      line("p50", d.decode.p50, COLORS.green), line("p10 (slowest)", d.decode.p10, COLORS.orange),
    ] } }),
  };

  function renderCharts(root) {
    if (typeof window.Chart === "undefined") return;
    root.querySelectorAll("canvas[data-chart]").forEach((canvas) => {
      const source = document.getElementById(canvas.dataset.source);
      const build = BUILDERS[canvas.dataset.chart];
      if (!source || !build) return;
      const existing = window.Chart.getChart(canvas);
      if (existing) existing.destroy();
      const config = build(JSON.parse(source.textContent));
      config.options = { responsive: true, maintainAspectRatio: false, animation: false,
        interaction: { mode: "index", intersect: false },
        scales: { x: { ticks: { maxTicksLimit: 12 } }, y: { beginAtZero: true } },
        plugins: { legend: { position: "bottom" } } };
      new window.Chart(canvas, config);
    });
  }

  function wireCopyButtons(root) {
    root.querySelectorAll("[data-copy]").forEach((button) => {
      button.addEventListener("click", () => {
        const text = document.getElementById(button.dataset.copy).textContent.trim();
        navigator.clipboard.writeText(text).then(() => { button.textContent = "Copied"; });
      });
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    renderCharts(document);
    wireCopyButtons(document);
  });
  document.addEventListener("htmx:afterSwap", (event) => renderCharts(event.target));
})();

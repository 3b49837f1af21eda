// Caller Memory dashboard: repeat-caller analytics of one project, drawn from the service's analytics API.
//
// Everything comes from this service (no framework, no CDN, no fonts), so it works offline. The token is kept
// in sessionStorage (this tab only) and sent only in the Authorization header of calls to this service, never
// in a URL. Data is written with textContent and setAttribute, never parsed as markup, so a stored string
// (a QA outcome, a handoff reason) cannot inject anything into the page.

const STORAGE_KEY = "caller-memory.dashboard";
const HOUR = 3_600_000;
const DAY = 24 * HOUR;
const WEEK = 7 * DAY;
const THURSDAY_TO_MONDAY = 4 * DAY; // 1970-01-01 was a Thursday; ISO weeks start on Monday 00:00 UTC
const RANGES = {
  "24h": { interval: "hour", step: HOUR, count: 24 },
  "30d": { interval: "day", step: DAY, count: 30 },
  "12w": { interval: "week", step: WEEK, count: 12 },
};
const RECENT_LIMIT = 20;
const CSV_PAGE_SIZE = 1000;
const TTC_LABELS = {
  same_hour: "Same hour",
  under_1_day: "Under 1 day",
  "1_to_7_days": "1 to 7 days",
  "7_to_30_days": "7 to 30 days",
  "30_days_or_more": "30 days or more",
};
const BREAKDOWNS = ["qa", "handoff_reason", "handoff_to", "attestation"];
// How a breakdown shows a value that was not recorded (null), in its rows and in the page's help, which has
// an element with data-label="none" wherever it names it: one word, written only here.
const NONE_LABEL = "(none)";
const RECENT_COLUMNS = [
  "ended_at",
  "conversation_id",
  "channel",
  "qa",
  "REPEAT_CALLER_CONV_ID",
  "REPEAT_CALLER_DATETIME",
  "REPEAT_CALLER_QA",
  "REPEAT_CALLER_HANDOFF_REASON",
  "REPEAT_CALLER_HANDOFF_TO",
  "time_to_callback_hours",
];
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);

/** An error whose message is meant for the person looking at the page. */
class DashboardError extends Error {}

// What is being shown: the project and token it was loaded with, and the report (for the CSV download).
let current = null;
// Incremented on every load, so that a slow answer to an earlier request never overwrites a newer one.
let generation = 0;

// Session storage ---------------------------------------------------------------------------------------

function stored() {
  try {
    return JSON.parse(sessionStorage.getItem(STORAGE_KEY) ?? "{}") ?? {};
  } catch {
    return {};
  }
}

function store(values) {
  sessionStorage.setItem(STORAGE_KEY, JSON.stringify(values));
}

// Time --------------------------------------------------------------------------------------------------

function bucketStart(interval, ms) {
  if (interval === "week") {
    return ms - ((((ms - THURSDAY_TO_MONDAY) % WEEK) + WEEK) % WEEK);
  }
  const step = interval === "hour" ? HOUR : DAY;
  return ms - (ms % step);
}

/** The whole buckets of a range, ending with the bucket that holds `now`. */
function rangeFor(key, now) {
  const { interval, step, count } = RANGES[key] ?? RANGES["30d"];
  const to = bucketStart(interval, now) + step;
  return { interval, from: to - count * step, to };
}

function iso(ms) {
  return new Date(ms).toISOString().replace(/\.\d{3}Z$/, "Z");
}

const DAY_LABEL = new Intl.DateTimeFormat("en-US", { timeZone: "UTC", month: "short", day: "numeric" });
const HOUR_LABEL = new Intl.DateTimeFormat("en-US", {
  timeZone: "UTC",
  hour: "2-digit",
  minute: "2-digit",
  hourCycle: "h23",
});
const DATE_LABEL = new Intl.DateTimeFormat("en-US", {
  timeZone: "UTC",
  year: "numeric",
  month: "short",
  day: "numeric",
});

function bucketLabel(interval, isoStart) {
  const date = new Date(isoStart);
  if (interval === "hour") return HOUR_LABEL.format(date);
  return (interval === "week" ? "week of " : "") + DAY_LABEL.format(date);
}

function dateTime(isoValue) {
  return isoValue ? isoValue.replace("T", " ").slice(0, 16) : null;
}

// Numbers -----------------------------------------------------------------------------------------------

function count(value) {
  return value.toLocaleString("en-US");
}

function percent(rate) {
  return rate === null || rate === undefined ? "–" : `${(rate * 100).toFixed(1)}%`;
}

/** Round axis ticks (0, 5, 10, ...) from 0 to at least `max`. */
function ticks(max) {
  const raw = Math.max(max, 1) / 4;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = Math.max(1, [1, 2, 5, 10].find((n) => n * magnitude >= raw) * magnitude);
  const top = Math.max(step, Math.ceil(max / step) * step);
  const out = [];
  for (let value = 0; value <= top; value += step) out.push(value);
  return out;
}

// Building elements (text is always a text node) ---------------------------------------------------------

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  node.append(...children);
  return node;
}

function svg(tag, attributes = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  node.append(...children);
  return node;
}

/** A table cell; null shows as a dash (or NONE_LABEL for a breakdown value). */
function cell(value, { numeric = false, none = "—" } = {}) {
  const empty = value === null || value === undefined;
  const td = element("td", { class: [numeric ? "num" : "", empty ? "none" : ""].join(" ").trim() });
  td.textContent = empty ? none : String(value);
  return td;
}

function shareCell(share) {
  const td = element("td", { class: "num share" });
  const bar = element("span", { class: "share-bar", "aria-hidden": "true" });
  // Set through the CSSOM, which the style-src policy allows (a style attribute in markup it would not).
  bar.style.width = `calc((100% - 76px) * ${(share ?? 0).toFixed(4)})`;
  td.append(bar, element("span", { class: "share-text" }, percent(share)));
  return td;
}

function emptyRow(columns, text) {
  return element("tr", { class: "empty" }, element("td", { colspan: columns }, text));
}

// Talking to the service ---------------------------------------------------------------------------------

async function request(session, endpoint, params, accept = "application/json") {
  const path = `v1/projects/${encodeURIComponent(session.project)}/analytics/${endpoint}`;
  const url = new URL(path, document.baseURI); // relative: works behind a path prefix too
  for (const [name, value] of Object.entries(params)) url.searchParams.set(name, String(value));
  let response;
  try {
    response = await fetch(url, {
      headers: { Authorization: `Bearer ${session.token}`, Accept: accept },
      cache: "no-store",
      credentials: "omit",
    });
  } catch {
    throw new DashboardError(
      "Could not reach the Caller Memory service. Check the network connection and that the service is " +
        "running, then try again.",
    );
  }
  if (!response.ok) throw new DashboardError(await explain(response, session.project));
  return response;
}

async function explain(response, project) {
  let detail = "";
  try {
    const problem = await response.json();
    if (typeof problem?.detail === "string") detail = problem.detail;
  } catch {
    // Not a problem document (a proxy's error page, say): the status says enough.
  }
  switch (response.status) {
    case 401:
      return (
        "The token was not accepted (401 Unauthorized). Check that you pasted the whole token and that it " +
        "has not been revoked."
      );
    case 403:
      return "This token may not read analytics (403 Forbidden). Use a token with the analytics or admin role.";
    case 404:
      return `Project "${project}" was not found, or the token belongs to another project (404 Not Found).`;
    default:
      return `The service answered ${response.status}${detail ? `: ${detail}` : "."}`;
  }
}

// Rendering ---------------------------------------------------------------------------------------------

function setStatus(message, kind) {
  const status = $("status");
  status.textContent = message;
  status.dataset.kind = kind;
  status.setAttribute("role", kind === "error" ? "alert" : "status");
}

function renderTotals(totals) {
  const figures = {
    "total-conversations": [totals.conversations, count(totals.conversations)],
    "total-repeat": [totals.repeat_conversations, count(totals.repeat_conversations)],
    "total-rate": [totals.repeat_rate ?? "", percent(totals.repeat_rate)],
  };
  for (const [id, [value, text]] of Object.entries(figures)) {
    $(id).textContent = text;
    $(id).dataset.value = String(value);
  }
}

function renderChart(report) {
  const { series, interval } = report;
  const width = 960;
  const height = 320;
  const margin = { top: 20, right: 64, bottom: 48, left: 64 };
  const plotWidth = width - margin.left - margin.right;
  const plotHeight = height - margin.top - margin.bottom;
  const baseline = margin.top + plotHeight;
  const axis = ticks(Math.max(0, ...series.map((bucket) => bucket.conversations)));
  const top = axis[axis.length - 1];
  const y = (value) => baseline - (value / top) * plotHeight;
  const yRate = (rate) => baseline - rate * plotHeight;
  const slot = plotWidth / Math.max(series.length, 1);
  const barWidth = Math.max(1, slot * 0.7);

  const busiest = series.reduce((best, bucket) => (bucket.conversations > best.conversations ? bucket : best), {
    conversations: -1,
  });
  const chart = svg(
    "svg",
    {
      viewBox: `0 0 ${width} ${height}`,
      role: "img",
      "aria-labelledby": "chart-title chart-desc",
      class: "chart-svg",
      "data-interval": interval,
      "data-from": report.from,
      "data-to": report.to,
    },
    svg("title", { id: "chart-title" }, `Conversations and repeat-caller rate per ${interval}`),
    svg(
      "desc",
      { id: "chart-desc" },
      `${series.length} ${interval}s from ${dateTime(report.from)} to ${dateTime(report.to)} UTC. ` +
        `${count(report.totals.conversations)} conversations, ${count(report.totals.repeat_conversations)} ` +
        `repeat (${percent(report.totals.repeat_rate)}).` +
        (busiest.conversations > 0
          ? ` Busiest ${interval}: ${bucketLabel(interval, busiest.start)} with ${busiest.conversations}.`
          : ""),
    ),
  );

  // Grid and axes: conversations on the left, repeat-caller rate (0 to 100%) on the right.
  const grid = svg("g", { class: "axis", "aria-hidden": "true" });
  for (const value of axis) {
    grid.append(
      svg("line", { x1: margin.left, x2: width - margin.right, y1: y(value), y2: y(value), class: "grid" }),
      svg("text", { x: margin.left - 8, y: y(value), class: "tick left" }, count(value)),
    );
  }
  for (const rate of [0, 0.25, 0.5, 0.75, 1]) {
    grid.append(svg("text", { x: width - margin.right + 8, y: yRate(rate), class: "tick right" }, percent(rate)));
  }
  const middle = margin.top + plotHeight / 2;
  grid.append(
    svg("text", { class: "axis-title", transform: `translate(16 ${middle}) rotate(-90)` }, "Conversations"),
    svg(
      "text",
      { class: "axis-title", transform: `translate(${width - 12} ${middle}) rotate(90)` },
      "Repeat-caller rate",
    ),
    svg("line", { x1: margin.left, x2: width - margin.right, y1: baseline, y2: baseline, class: "baseline" }),
  );
  chart.append(grid);

  // One group per bucket, carrying its figures (data-*) and a tooltip (<title>).
  const labelEvery = Math.ceil(series.length / 12);
  const bars = svg("g", { class: "bars" });
  const points = [];
  series.forEach((bucket, index) => {
    const x = margin.left + index * slot + (slot - barWidth) / 2;
    const label = bucketLabel(interval, bucket.start);
    const group = svg(
      "g",
      {
        class: "bucket",
        "data-start": bucket.start,
        "data-conversations": bucket.conversations,
        "data-repeat-conversations": bucket.repeat_conversations,
        "data-first-conversations": bucket.first_conversations,
        "data-repeat-rate": bucket.repeat_rate ?? "",
        "data-distinct-callers": bucket.distinct_callers,
      },
      svg(
        "title",
        {},
        `${label}: ${count(bucket.conversations)} conversations, ${count(bucket.repeat_conversations)} repeat ` +
          `(${percent(bucket.repeat_rate)}), ${count(bucket.distinct_callers)} distinct callers`,
      ),
      svg("rect", { x: margin.left + index * slot, y: margin.top, width: slot, height: plotHeight, class: "hit" }),
      svg("rect", {
        x,
        y: y(bucket.conversations),
        width: barWidth,
        height: y(bucket.repeat_conversations) - y(bucket.conversations),
        class: "bar first",
      }),
      svg("rect", {
        x,
        y: y(bucket.repeat_conversations),
        width: barWidth,
        height: baseline - y(bucket.repeat_conversations),
        class: "bar repeat",
      }),
    );
    if (index % labelEvery === 0) {
      group.append(svg("text", { x: x + barWidth / 2, y: baseline + 18, class: "tick bottom" }, label));
    }
    bars.append(group);
    points.push(bucket.repeat_rate === null ? null : [x + barWidth / 2, yRate(bucket.repeat_rate)]);
  });
  chart.append(bars);

  // The rate as a line, broken where a bucket has no conversations (no rate to draw).
  const line = svg("g", { class: "rate", "aria-hidden": "true" });
  let segment = [];
  for (const point of [...points, null]) {
    if (point) {
      segment.push(point);
      line.append(svg("circle", { cx: point[0], cy: point[1], r: 3, class: "rate-dot" }));
    } else if (segment.length) {
      line.append(svg("polyline", { points: segment.map((p) => p.join(",")).join(" "), class: "rate-line" }));
      segment = [];
    }
  }
  chart.append(line);
  $("chart").replaceChildren(chart);
}

function renderTimeToCallback(report) {
  const total = report.totals.repeat_conversations;
  const rows = report.time_to_callback.map((row) =>
    element(
      "tr",
      { "data-bucket": row.bucket },
      cell(TTC_LABELS[row.bucket] ?? row.bucket),
      cell(count(row.repeat_conversations), { numeric: true }),
      shareCell(total ? row.repeat_conversations / total : null),
    ),
  );
  $("ttc").tBodies[0].replaceChildren(...rows);
}

function renderBreakdowns(report) {
  for (const dimension of BREAKDOWNS) {
    const rows = report.breakdowns[dimension].map((row) =>
      element(
        "tr",
        {},
        cell(row.value, { none: NONE_LABEL }),
        cell(count(row.repeat_conversations), { numeric: true }),
        shareCell(row.share),
      ),
    );
    $(`breakdown-${dimension}`).tBodies[0].replaceChildren(
      ...(rows.length ? rows : [emptyRow(3, "No repeat calls in this range.")]),
    );
  }
}

function renderRecent(conversations) {
  const rows = conversations.map((conversation) =>
    element(
      "tr",
      { "data-conversation-id": conversation.conversation_id },
      ...RECENT_COLUMNS.map((column) => {
        const value = conversation[column];
        if (column === "ended_at" || column === "REPEAT_CALLER_DATETIME") return cell(dateTime(value));
        return cell(value, { numeric: column === "time_to_callback_hours" });
      }),
    ),
  );
  $("recent").tBodies[0].replaceChildren(...rows);
  $("recent").hidden = rows.length === 0;
  $("recent-empty").hidden = rows.length > 0;
}

function render(report, recent, project) {
  $("range-label").textContent =
    `Project ${project} · ${DATE_LABEL.format(new Date(report.from))} ${dateTime(report.from).slice(11)} ` +
    `to ${DATE_LABEL.format(new Date(report.to))} ${dateTime(report.to).slice(11)} UTC, by ${report.interval}`;
  renderTotals(report.totals);
  renderChart(report);
  renderTimeToCallback(report);
  renderBreakdowns(report);
  renderRecent(recent);
  $("report").hidden = false;
}

// Actions -----------------------------------------------------------------------------------------------

async function load(session, rangeKey) {
  const ticket = ++generation;
  setStatus("Loading…", "busy");
  const range = rangeFor(rangeKey, Date.now());
  const span = { from: iso(range.from), to: iso(range.to) };
  try {
    const [report, listing] = await Promise.all([
      request(session, "repeat-callers", { ...span, interval: range.interval }).then((r) => r.json()),
      request(session, "conversations", { ...span, repeat: "true", order: "desc", limit: RECENT_LIMIT }).then(
        (r) => r.json(),
      ),
    ]);
    if (ticket !== generation) return;
    current = { session, report };
    render(report, listing.conversations, session.project);
    setStatus(`Updated at ${HOUR_LABEL.format(new Date())} UTC.`, "ok");
  } catch (error) {
    if (ticket !== generation) return;
    current = null;
    $("report").hidden = true;
    setStatus(error instanceof DashboardError ? error.message : `Something went wrong: ${error.message}`, "error");
  }
}

/** Every conversation of the range shown, as one CSV file (following the pages), saved via a Blob URL. */
async function downloadCsv() {
  if (!current) return;
  const { session, report } = current;
  const button = $("download");
  button.disabled = true;
  setStatus("Preparing the CSV file…", "busy");
  try {
    const parts = [];
    let cursor = null;
    do {
      const params = { from: report.from, to: report.to, order: "desc", limit: CSV_PAGE_SIZE };
      if (cursor) params.cursor = cursor;
      const response = await request(session, "conversations", params, "text/csv");
      const text = await response.text();
      parts.push(parts.length ? text.slice(text.indexOf("\n") + 1) : text); // one header line only
      cursor = response.headers.get("X-Next-Cursor");
    } while (cursor);
    const url = URL.createObjectURL(new Blob(parts, { type: "text/csv;charset=utf-8" }));
    const link = element("a", {
      href: url,
      download: `caller-memory-${session.project}-${report.from.slice(0, 10)}-to-${report.to.slice(0, 10)}.csv`,
      hidden: "",
    });
    document.body.append(link);
    link.click();
    link.remove();
    // The download has started from the URL; release it once the browser has surely read it.
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
    setStatus("CSV file downloaded.", "ok");
  } catch (error) {
    setStatus(error instanceof DashboardError ? error.message : `Something went wrong: ${error.message}`, "error");
  } finally {
    button.disabled = false;
  }
}

function submit(event) {
  event.preventDefault();
  const project = $("project").value.trim();
  const token = $("token").value.trim();
  if (!project || !$("project").checkValidity()) {
    setStatus("Enter a project id: lowercase letters, digits, '-' or '_' (at most 63).", "error");
    $("project").focus();
    return;
  }
  if (!token) {
    setStatus("Enter a token with the analytics or admin role.", "error");
    $("token").focus();
    return;
  }
  store({ project, token, range: $("range").value });
  load({ project, token }, $("range").value);
}

function forgetToken() {
  generation++; // an answer still in flight is not shown
  current = null;
  const { project, range } = stored();
  store({ project, range });
  $("token").value = "";
  $("report").hidden = true;
  setStatus("The token is forgotten: it is no longer kept in this browser tab.", "ok");
  $("token").focus();
}

function changeRange() {
  const saved = stored();
  store({ ...saved, range: $("range").value });
  if (current) load(current.session, $("range").value);
}

function start() {
  for (const label of document.querySelectorAll('[data-label="none"]')) label.textContent = NONE_LABEL;
  const saved = stored();
  if (saved.project) $("project").value = saved.project;
  if (saved.token) $("token").value = saved.token;
  if (saved.range in RANGES) $("range").value = saved.range;
  $("connect").addEventListener("submit", submit);
  $("forget").addEventListener("click", forgetToken);
  $("range").addEventListener("change", changeRange);
  $("download").addEventListener("click", downloadCsv);
  if (saved.project && saved.token) load({ project: saved.project, token: saved.token }, $("range").value);
}

start();

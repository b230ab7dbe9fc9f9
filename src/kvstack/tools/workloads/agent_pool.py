"""The agent-loop workload's tool pool: 16 realistic OpenAI function schemas.

Each :class:`PoolTool` is an OpenAI ``tools`` entry in the style of OpenAI's strict
function calling (``additionalProperties: false``, enums, bounded integers, patterns,
bounded strings), three example tasks a user could ask for it (the text of a user turn
and the arguments an ideal model would call it with: the scripted calls of the JSONL
form of the workload) and the fields its synthetic results carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PoolTool:
    """One tool of :data:`TOOL_POOL`."""

    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}
    examples: tuple[tuple[str, dict[str, Any]], ...]  # (user request, ideal arguments)
    result_fields: tuple[str, ...]  # keys of its synthetic result, besides "status"

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    @property
    def parameters(self) -> dict[str, Any]:
        return dict(self.schema["function"]["parameters"])


def _s(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def _i(desc: str, lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "description": desc, "minimum": lo, "maximum": hi}


def _e(desc: str, *values: str) -> dict[str, Any]:
    return {"type": "string", "description": desc, "enum": list(values)}


def _tool(
    name: str,
    desc: str,
    props: dict[str, Any],
    required: list[str],
    examples: tuple[tuple[str, dict[str, Any]], ...],
    result_fields: tuple[str, ...],
) -> PoolTool:
    params = {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }
    schema = {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": params},
    }
    return PoolTool(schema, examples, result_fields)


_DATE = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
_IATA = "^[A-Z]{3}$"

TOOL_POOL: tuple[PoolTool, ...] = (
    _tool(
        "get_weather",
        "Get the current weather and a daily forecast for a city.",
        {
            "city": _s("City name, e.g. 'Lisbon'", maxLength=40),
            "unit": _e("Temperature unit", "celsius", "fahrenheit"),
            "days": _i("Days of forecast", 1, 7),
        },
        ["city"],
        (
            (
                "What will the weather be like in Lisbon for the next three days?",
                {"city": "Lisbon", "days": 3},
            ),
            (
                "Is it going to rain in Seattle tomorrow? Use fahrenheit.",
                {"city": "Seattle", "unit": "fahrenheit", "days": 1},
            ),
            ("How cold is it in Oslo right now?", {"city": "Oslo", "unit": "celsius"}),
        ),
        ("temperature", "conditions", "wind_kph"),
    ),
    _tool(
        "search_docs",
        "Search the product documentation and return the most relevant passages.",
        {
            "query": _s("Search terms", maxLength=80),
            "section": _e("Part of the docs to search", "api", "guides", "faq", "changelog"),
            "top_k": _i("Number of passages to return", 1, 10),
        },
        ["query"],
        (
            (
                "How do I rotate an API key? Check the docs.",
                {"query": "rotate API key", "section": "guides"},
            ),
            (
                "Find the changelog entry about the new rate limits.",
                {"query": "rate limits", "section": "changelog", "top_k": 3},
            ),
            ("What does error code 4012 mean?", {"query": "error code 4012", "section": "faq"}),
        ),
        ("passages", "total_hits"),
    ),
    _tool(
        "run_sql",
        "Run a read-only SQL query against one of the company databases.",
        {
            "query": _s("A single SELECT statement", maxLength=160),
            "database": _e("Database to query", "sales", "inventory", "users", "analytics"),
            "limit": _i("Maximum rows to return", 1, 500),
        },
        ["query", "database"],
        (
            (
                "How many orders did we get last week?",
                {"query": "SELECT count(*) FROM orders WHERE week = 'last'", "database": "sales"},
            ),
            (
                "List the ten products with the lowest stock.",
                {
                    "query": "SELECT name, stock FROM products ORDER BY stock",
                    "database": "inventory",
                    "limit": 10,
                },
            ),
            (
                "How many users signed up in March?",
                {"query": "SELECT count(*) FROM users WHERE month = 3", "database": "users"},
            ),
        ),
        ("columns", "rows", "row_count"),
    ),
    _tool(
        "send_email",
        "Send an email on behalf of the user.",
        {
            "to": _s("Recipient address", maxLength=60),
            "subject": _s("Subject line", maxLength=80),
            "body": _s("Plain-text body", maxLength=240),
            "priority": _e("Delivery priority", "low", "normal", "high"),
        },
        ["to", "subject", "body"],
        (
            (
                "Email anna@example.com that the meeting moved to 3pm.",
                {
                    "to": "anna@example.com",
                    "subject": "Meeting moved",
                    "body": "Hi Anna, the meeting is now at 3pm.",
                },
            ),
            (
                "Tell the team at team@example.com the release is done, high priority.",
                {
                    "to": "team@example.com",
                    "subject": "Release done",
                    "body": "The release is done.",
                    "priority": "high",
                },
            ),
            (
                "Send bob@example.com a thank-you note for the review.",
                {
                    "to": "bob@example.com",
                    "subject": "Thanks",
                    "body": "Thanks for the review, Bob.",
                },
            ),
        ),
        ("message_id", "queued_at"),
    ),
    _tool(
        "create_calendar_event",
        "Create an event in the user's calendar.",
        {
            "title": _s("Event title", maxLength=60),
            "date": _s("Date, YYYY-MM-DD", pattern=_DATE),
            "start_hour": _i("Start hour, 24h clock", 0, 23),
            "duration_minutes": _i("Length of the event", 15, 480),
        },
        ["title", "date", "start_hour"],
        (
            (
                "Put a dentist appointment on 2025-03-14 at 9.",
                {"title": "Dentist", "date": "2025-03-14", "start_hour": 9},
            ),
            (
                "Book a two-hour planning session on 2025-04-02 at 14.",
                {
                    "title": "Planning session",
                    "date": "2025-04-02",
                    "start_hour": 14,
                    "duration_minutes": 120,
                },
            ),
            (
                "Add lunch with Sam on 2025-05-20 at noon.",
                {"title": "Lunch with Sam", "date": "2025-05-20", "start_hour": 12},
            ),
        ),
        ("event_id", "calendar", "conflicts"),
    ),
    _tool(
        "get_stock_price",
        "Get the latest price of a stock by its ticker symbol.",
        {
            "symbol": _s("Ticker, e.g. AAPL", pattern="^[A-Z]{1,5}$"),
            "exchange": _e("Exchange", "NASDAQ", "NYSE", "LSE", "TSE"),
        },
        ["symbol"],
        (
            ("What is Apple trading at?", {"symbol": "AAPL", "exchange": "NASDAQ"}),
            ("Check the price of IBM.", {"symbol": "IBM", "exchange": "NYSE"}),
            ("How is Toyota doing on the Tokyo exchange?", {"symbol": "TM", "exchange": "TSE"}),
        ),
        ("price", "currency", "change_pct"),
    ),
    _tool(
        "translate_text",
        "Translate a short text into another language.",
        {
            "text": _s("Text to translate", maxLength=200),
            "target_language": _e("Language", "english", "french", "german", "spanish", "japanese"),
            "formality": _e("Register", "formal", "informal"),
        },
        ["text", "target_language"],
        (
            (
                "Translate 'where is the station' into German.",
                {"text": "where is the station", "target_language": "german"},
            ),
            (
                "Say 'thank you for your patience' in Japanese, formally.",
                {
                    "text": "thank you for your patience",
                    "target_language": "japanese",
                    "formality": "formal",
                },
            ),
            (
                "How do I say 'see you tomorrow' in Spanish?",
                {"text": "see you tomorrow", "target_language": "spanish"},
            ),
        ),
        ("translation", "detected_language"),
    ),
    _tool(
        "book_flight",
        "Search and hold a flight between two airports.",
        {
            "origin": _s("IATA code of the departure airport", pattern=_IATA),
            "destination": _s("IATA code of the arrival airport", pattern=_IATA),
            "date": _s("Departure date, YYYY-MM-DD", pattern=_DATE),
            "passengers": _i("Number of passengers", 1, 9),
            "cabin": _e("Cabin class", "economy", "premium", "business", "first"),
        },
        ["origin", "destination", "date"],
        (
            (
                "Find me a flight from LIS to JFK on 2025-06-01.",
                {"origin": "LIS", "destination": "JFK", "date": "2025-06-01"},
            ),
            (
                "Two business seats from SFO to NRT on 2025-07-15.",
                {
                    "origin": "SFO",
                    "destination": "NRT",
                    "date": "2025-07-15",
                    "passengers": 2,
                    "cabin": "business",
                },
            ),
            (
                "I need to get from LHR to CDG on 2025-02-10.",
                {"origin": "LHR", "destination": "CDG", "date": "2025-02-10"},
            ),
        ),
        ("flight_number", "departure_time", "price_usd"),
    ),
    _tool(
        "get_order_status",
        "Look up the shipping status of a customer order.",
        {"order_id": _s("Order id, e.g. ORD-123456", pattern="^ORD-[0-9]{6}$")},
        ["order_id"],
        (
            ("Where is my order ORD-104233?", {"order_id": "ORD-104233"}),
            ("Has ORD-553001 shipped yet?", {"order_id": "ORD-553001"}),
            ("Check the status of order ORD-900417.", {"order_id": "ORD-900417"}),
        ),
        ("state", "carrier", "eta"),
    ),
    _tool(
        "create_ticket",
        "Open a ticket in the issue tracker.",
        {
            "title": _s("Short summary", maxLength=80),
            "priority": _e("Priority", "low", "medium", "high", "urgent"),
            "component": _e("Component", "frontend", "backend", "billing", "infra"),
            "description": _s("What happened", maxLength=240),
        },
        ["title", "priority", "component"],
        (
            (
                "File an urgent ticket: checkout page crashes on submit.",
                {
                    "title": "Checkout page crashes on submit",
                    "priority": "urgent",
                    "component": "frontend",
                },
            ),
            (
                "Open a low-priority billing ticket about a typo on invoices.",
                {"title": "Typo on invoices", "priority": "low", "component": "billing"},
            ),
            (
                "Report that the nightly backup job failed twice.",
                {"title": "Nightly backup failed twice", "priority": "high", "component": "infra"},
            ),
        ),
        ("ticket_id", "url"),
    ),
    _tool(
        "read_file",
        "Read a text file from the project workspace.",
        {
            "path": _s("Path relative to the workspace root", maxLength=120),
            "max_lines": _i("Lines to return at most", 1, 400),
        },
        ["path"],
        (
            ("Show me the README.", {"path": "README.md"}),
            (
                "Open src/app/config.py, the first 50 lines.",
                {"path": "src/app/config.py", "max_lines": 50},
            ),
            ("What is in docs/setup.md?", {"path": "docs/setup.md"}),
        ),
        ("content", "total_lines"),
    ),
    _tool(
        "web_search",
        "Search the web and return result titles, links and snippets.",
        {
            "query": _s("Search query", maxLength=100),
            "num_results": _i("Results to return", 1, 10),
            "recency": _e("How recent", "day", "week", "month", "any"),
        },
        ["query"],
        (
            (
                "Search the web for reviews of the new Pixel phone.",
                {"query": "Pixel phone review", "recency": "month"},
            ),
            (
                "Look up today's news about the Mars mission.",
                {"query": "Mars mission news", "recency": "day"},
            ),
            (
                "Find three tutorials on sourdough bread.",
                {"query": "sourdough bread tutorial", "num_results": 3},
            ),
        ),
        ("results", "total_results"),
    ),
    _tool(
        "convert_currency",
        "Convert an amount between two currencies at today's rate.",
        {
            "amount": {"type": "number", "description": "Amount to convert", "minimum": 0},
            "from_currency": _s("ISO code, e.g. EUR", pattern=_IATA),
            "to_currency": _s("ISO code, e.g. USD", pattern=_IATA),
        },
        ["amount", "from_currency", "to_currency"],
        (
            (
                "How much is 250 euros in dollars?",
                {"amount": 250, "from_currency": "EUR", "to_currency": "USD"},
            ),
            (
                "Convert 10000 yen to pounds.",
                {"amount": 10000, "from_currency": "JPY", "to_currency": "GBP"},
            ),
            (
                "What are 75 Swiss francs in euros?",
                {"amount": 75, "from_currency": "CHF", "to_currency": "EUR"},
            ),
        ),
        ("converted", "rate", "as_of"),
    ),
    _tool(
        "get_directions",
        "Get a route between two places.",
        {
            "origin": _s("Start address or place", maxLength=80),
            "destination": _s("End address or place", maxLength=80),
            "mode": _e("Travel mode", "driving", "walking", "transit", "cycling"),
        },
        ["origin", "destination"],
        (
            (
                "How do I walk from the Louvre to the Eiffel Tower?",
                {"origin": "Louvre", "destination": "Eiffel Tower", "mode": "walking"},
            ),
            (
                "Directions from Central Station to the airport by transit.",
                {"origin": "Central Station", "destination": "Airport", "mode": "transit"},
            ),
            (
                "Drive from Boston to Providence.",
                {"origin": "Boston", "destination": "Providence", "mode": "driving"},
            ),
        ),
        ("distance_km", "duration_min", "steps"),
    ),
    _tool(
        "set_reminder",
        "Set a reminder that notifies the user later.",
        {
            "text": _s("What to remind the user of", maxLength=120),
            "minutes_from_now": _i("When, in minutes from now", 1, 10080),
        },
        ["text", "minutes_from_now"],
        (
            ("Remind me to call mom in 30 minutes.", {"text": "Call mom", "minutes_from_now": 30}),
            (
                "In two hours, remind me to take the laundry out.",
                {"text": "Take the laundry out", "minutes_from_now": 120},
            ),
            (
                "Remind me tomorrow to renew the parking permit.",
                {"text": "Renew the parking permit", "minutes_from_now": 1440},
            ),
        ),
        ("reminder_id", "fires_at"),
    ),
    _tool(
        "lookup_customer",
        "Find a customer record by email address.",
        {
            "email": _s("Customer email", maxLength=60),
            "include_orders": {"type": "boolean", "description": "Also list recent orders"},
        },
        ["email"],
        (
            ("Pull up the account of jane@example.com.", {"email": "jane@example.com"}),
            (
                "Who is li.wei@example.com and what did they order?",
                {"email": "li.wei@example.com", "include_orders": True},
            ),
            ("Find the customer omar@example.com.", {"email": "omar@example.com"}),
        ),
        ("customer_id", "name", "tier", "orders"),
    ),
)
POOL_SIZE = len(TOOL_POOL)

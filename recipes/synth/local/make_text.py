"""Sentence generator of the synthetic-speech recipe: word lists and templates written for it.

Three worlds share one vocabulary and no template: the training templates, the dev templates
(DEV_TEMPLATE_COUNT of TRAIN_TEMPLATES held out with the seed, `dev_templates`) and TEST_TEMPLATES,
so that dev and test measure the recognizer on sentence frames it never heard: every slot kind
(verb forms included) and literal word of a dev or test template is used by some training
template. Words are the other way: dev and test each hold their own unseen words (`unseen_words`:
a share of the names, places, things, foods, animals and jobs) that no training or LM sentence
ever holds.

A template is a string of literal words and slots: `{kind}` or `{kind:form}` (verb forms: base,
past, ing, s, pp). Each slot draws a phrase from the word lists below. Output is normalized the
toolkit's way: upper-case letters, digits, apostrophes inside words and single spaces.

The recipe's training set replaces most template sentences by spliced ones (`splice_some`): runs
of 2-5 words cut from several training sentences and joined, so that the model learns words and
word pairs rather than whole frames; and a tenth of them by random words of the vocabulary
(`random_words_some`), so that it does not hold on to the word pairs either. A clause grammar
(`clauses`) writes more English word sequences for the recipe's word LM (text only, no audio)
from the training vocabulary, knowing nothing of the dev and test templates.

    python recipes/synth/local/make_text.py --num 5 --split test --seed 1   # Kaldi-style lines
"""
from __future__ import annotations

import argparse
import functools
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

# --- word lists (multi-word entries joined with "_") ---------------------------------------------


def _words(text: str) -> list[str]:
    """Whitespace-separated entries, "_" standing for a space inside an entry."""
    return [w.replace("_", " ") for w in text.split()]


FIRST_NAMES = _words("""
ANNA BEN CLARA DANIEL EMMA FELIX GRACE HENRY ISABEL JACK KATE LEO LUCY MARTIN NINA OSCAR
PETER RACHEL SAM SARAH THOMAS VICTOR WENDY ZOE ALICE ARTHUR BELLA CHARLIE DAVID EDWARD ELLA
FRANK GEORGE HANNAH HARRY IRENE JAMES JANE JOHN JULIA KEVIN LAURA LILY LOUIS MARY MAX MIA
MICHAEL MOLLY NATHAN OLIVER OLIVIA PAUL RITA ROBERT ROSE RUBY SIMON SOPHIE STEVEN SUSAN TOM
ADAM AMY ANDREW ALEX BRIAN CAROL CHLOE CLAIRE DIANA EVA FIONA GARY HELEN IAN JASON JESSICA
KAREN LISA MARK MEGAN NICK PATRICK RICHARD SOPHIA TINA WILLIAM AARON ALAN AMELIA ANGELA CARL
CHRIS DAISY DEREK EMILY ERIC GEMMA GORDON HARVEY HOLLY ISAAC JOSH KELLY LEWIS LOGAN MAGGIE
MATT NORA OWEN PHILIP RUTH SCOTT STELLA TERRY TESSA WALTER YVONNE ZACK AIDAN BRUNO CONNOR
DORIS EDITH ELLIOT FREDDIE GRETA HUGO IVY JASPER JUNE KEITH LEAH MABEL NEIL PAULA QUENTIN
RALPH SEAN TARA VERA WADE ALBERT BETTY CECIL DORA ELSIE FLORA GILBERT HAZEL IRIS JEAN LIAM
MOIRA NOAH PENNY ROSS SALLY TED URSULA VINCENT
""")

SURNAMES = _words("""
SMITH JONES TAYLOR BROWN WILSON EVANS THOMAS JOHNSON ROBERTS WALKER WRIGHT ROBINSON THOMPSON
WHITE HUGHES EDWARDS GREEN HALL WOOD HARRIS LEWIS MARTIN JACKSON CLARKE CLARK TURNER HILL
SCOTT COOPER MORRIS WARD MOORE KING WATSON BAKER HARRISON MORGAN PATEL YOUNG ALLEN MITCHELL
JAMES ANDERSON PHILLIPS LEE BELL PARKER DAVIS MILLER GARCIA MARTINEZ LOPEZ MILLS PRICE BENNETT
GRAY COX RICHARDS PALMER HUNT FOSTER CAMPBELL MURPHY KELLY O'BRIEN MURRAY STEWART FLETCHER
BARNES CHAPMAN HOLMES ELLIS SHAW DIXON FISHER HAYES MARSHALL GRANT REID PORTER WEBB CARTER
FERGUSON HOWARD MASON OWEN GRAHAM KNIGHT BUTLER RUSSELL LAWSON SPENCER DUNCAN FORD CROSS
""")

CITIES = _words("""
LONDON PARIS BERLIN MADRID ROME VIENNA DUBLIN EDINBURGH GLASGOW MANCHESTER LIVERPOOL LEEDS
BRISTOL CARDIFF BELFAST OXFORD CAMBRIDGE YORK BRIGHTON NEW_YORK BOSTON CHICAGO DENVER SEATTLE
DALLAS HOUSTON MIAMI ATLANTA PHOENIX TORONTO MONTREAL VANCOUVER SYDNEY MELBOURNE PERTH
AUCKLAND TOKYO OSAKA SEOUL BEIJING SHANGHAI MUMBAI DELHI CAIRO NAIROBI LAGOS ACCRA
JOHANNESBURG LISBON PORTO BARCELONA VALENCIA MILAN VENICE NAPLES ATHENS PRAGUE WARSAW
BUDAPEST STOCKHOLM OSLO HELSINKI COPENHAGEN AMSTERDAM BRUSSELS GENEVA ZURICH MUNICH HAMBURG
ISTANBUL MOSCOW LIMA SANTIAGO BOGOTA MEXICO_CITY HAVANA KINGSTON DETROIT PORTLAND
ABERDEEN DUNDEE INVERNESS NEWCASTLE SHEFFIELD NOTTINGHAM LEICESTER COVENTRY PLYMOUTH EXETER
NORWICH BATH CHESTER DOVER
""")

COUNTRIES = _words("""
FRANCE SPAIN ITALY GERMANY PORTUGAL IRELAND SCOTLAND ENGLAND WALES CANADA MEXICO BRAZIL
ARGENTINA CHILE PERU JAPAN CHINA INDIA KOREA EGYPT KENYA NIGERIA GHANA AUSTRALIA
NEW_ZEALAND NORWAY SWEDEN FINLAND DENMARK ICELAND POLAND AUSTRIA GREECE TURKEY HUNGARY
BELGIUM HOLLAND SWITZERLAND RUSSIA JAMAICA CUBA MOROCCO VIETNAM THAILAND CROATIA ROMANIA
""")

TOWN_PLACES = _words("""
LIBRARY STATION MARKET HOSPITAL SCHOOL OFFICE MUSEUM THEATRE CINEMA BAKERY PHARMACY GARAGE
HARBOUR AIRPORT PARK BEACH GARDEN CHURCH CASTLE BRIDGE FACTORY HOTEL RESTAURANT CAFE BANK
POST_OFFICE BUS_STOP SUPERMARKET STADIUM ZOO FARM VILLAGE HALL GYM POOL CLINIC BOOKSHOP
BUTCHER'S PUB TOWER PALACE CATHEDRAL UNIVERSITY COLLEGE KITCHEN CELLAR ATTIC BASEMENT LAKE
RIVER FOREST HILL VALLEY ISLAND CAMPSITE PLAYGROUND
""")

THINGS = _words("""
CUP PLATE BOWL SPOON FORK KNIFE GLASS BOTTLE JAR BOX BAG BASKET BUCKET CHAIR TABLE DESK SOFA
BED LAMP CLOCK MIRROR PILLOW BLANKET TOWEL CARPET CURTAIN WINDOW DOOR KEY LOCK BOOK
NOTEBOOK PENCIL PEN RULER ENVELOPE LETTER PARCEL PACKAGE MAP TICKET WALLET PURSE UMBRELLA
CAMERA PHONE RADIO TELEVISION COMPUTER LAPTOP KEYBOARD PRINTER CABLE BATTERY CHARGER
HAMMER SAW LADDER ROPE CANDLE MATCH BRUSH COMB SPONGE SOAP KETTLE TOASTER OVEN FRIDGE
FREEZER SINK TAP SHELF DRAWER CUPBOARD SUITCASE BACKPACK WATCH RING NECKLACE BRACELET
GUITAR PIANO VIOLIN DRUM FLUTE TRUMPET BALL KITE PUZZLE DOLL ROBOT CANDLESTICK VASE
PAINTING PHOTOGRAPH POSTER CALENDAR NEWSPAPER MAGAZINE DIARY RECEIPT NEEDLE BUTTON
SCISSORS TAPE GLUE STAMP COIN BADGE FLAG TENT TORCH COMPASS HELMET GLOVE SCARF HAT COAT
JACKET SHIRT SWEATER DRESS SKIRT SOCK SHOE BOOT SANDAL BELT TIE PAN POT TRAY TEAPOT MUG
BENCH FENCE GATE STOOL CUSHION RUG HOSE SHOVEL WHEELBARROW BICYCLE SCOOTER SKATEBOARD
WAGON TRUCK VAN CAR TRAIN BUS TAXI BOAT SHIP YACHT CANOE PLANE TRACTOR MOTORBIKE
""")

FOODS = _words("""
APPLE BANANA ORANGE LEMON PEAR PLUM PEACH CHERRY GRAPE MELON PINEAPPLE STRAWBERRY TOMATO
POTATO CARROT ONION CUCUMBER PEPPER MUSHROOM CABBAGE PUMPKIN SANDWICH BISCUIT COOKIE CAKE
MUFFIN PIE PIZZA BURGER SAUSAGE EGG PANCAKE WAFFLE DONUT CROISSANT BAGEL PRETZEL OMELETTE
SALAD NOODLE DUMPLING TACO CURRY CHOCOLATE_BAR LOLLIPOP PEANUT ALMOND OLIVE AVOCADO
COCONUT RADISH TURNIP APRICOT MANGO KIWI
""")

DRINKS = _words("COFFEE TEA JUICE WATER MILK LEMONADE SOUP HOT_CHOCOLATE ORANGE_JUICE COCOA")

MASS_FOODS = _words("""
BREAD RICE SOUP CHEESE BUTTER MILK COFFEE TEA JUICE WATER HONEY JAM PASTA CEREAL YOGURT
CHICKEN FISH BEEF PORRIDGE LEMONADE SUGAR SALT FLOUR TOAST CHOCOLATE ICE_CREAM CREAM
""")

ANIMALS = _words("""
DOG CAT HORSE COW PIG SHEEP GOAT DUCK GOOSE CHICKEN RABBIT MOUSE RAT HAMSTER PARROT OWL
EAGLE CROW PIGEON ROBIN SWAN FOX WOLF BEAR DEER LION TIGER ELEPHANT GIRAFFE ZEBRA MONKEY
DONKEY CAMEL KANGAROO PENGUIN DOLPHIN WHALE SHARK SEAL OTTER BEAVER SQUIRREL HEDGEHOG FROG
TURTLE LIZARD SNAKE SPIDER BEE BUTTERFLY BEETLE SNAIL PONY PUPPY KITTEN
""")

JOBS = _words("""
DOCTOR NURSE TEACHER DRIVER FARMER BAKER BUTCHER PILOT SAILOR SOLDIER POLICE_OFFICER
FIREFIGHTER PLUMBER ELECTRICIAN CARPENTER PAINTER GARDENER WAITER WAITRESS CHEF COOK
LAWYER JUDGE DENTIST ENGINEER SCIENTIST PROFESSOR STUDENT LIBRARIAN SECRETARY MANAGER
SHOPKEEPER CASHIER MECHANIC POSTMAN JOURNALIST PHOTOGRAPHER MUSICIAN SINGER DANCER ACTOR
ARTIST WRITER ARCHITECT ACCOUNTANT BANKER CLEANER GUARD FISHERMAN VET TAILOR
""")

RELATIVES = _words("""
MOTHER FATHER SISTER BROTHER AUNT UNCLE COUSIN GRANDMOTHER GRANDFATHER GRANDMA GRANDPA
NEPHEW NIECE SON DAUGHTER WIFE HUSBAND MUM DAD FRIEND NEIGHBOUR BOSS COLLEAGUE PARTNER
FLATMATE TEAMMATE
""")

COLORS = _words("""
RED BLUE GREEN YELLOW BLACK WHITE BROWN GREY PINK PURPLE ORANGE SILVER GOLDEN DARK LIGHT
""")

ADJECTIVES = _words("""
BIG SMALL LARGE TINY HUGE LONG SHORT TALL WIDE NARROW HEAVY OLD NEW YOUNG FRESH CLEAN
DIRTY EMPTY FULL HOT COLD WARM COOL WET DRY SOFT HARD SMOOTH ROUGH SHARP BLUNT BRIGHT DULL
CHEAP EXPENSIVE FAST SLOW LOUD QUIET EASY DIFFICULT SIMPLE STRANGE FAMOUS PRETTY UGLY
LOVELY NICE FINE GOOD BAD BROKEN SPARE PLASTIC WOODEN METAL GLASS PAPER SILK WOOLLEN SHINY
SPOTTED STRIPED ROUND SQUARE USEFUL USELESS FAVOURITE SPECIAL ORDINARY PERFECT PRECIOUS
ANCIENT MODERN ENORMOUS DELICATE STURDY FANCY PLAIN DUSTY RUSTY STICKY
""")

FEELINGS = _words("""
HAPPY SAD TIRED HUNGRY THIRSTY ANGRY BUSY BORED CALM BRAVE PROUD SHY LATE EARLY READY
SLEEPY NERVOUS EXCITED WORRIED SURPRISED CHEERFUL GRATEFUL LONELY SICK WELL HOME AWAY
LUCKY CAREFUL FRIENDLY POLITE CURIOUS JEALOUS CONFUSED RELAXED UPSET THRILLED
""")

ADVERBS = _words("""
QUICKLY SLOWLY CAREFULLY QUIETLY LOUDLY HAPPILY SADLY EASILY GENTLY SUDDENLY FINALLY
PROBABLY CERTAINLY REALLY NEARLY ALMOST ALWAYS NEVER OFTEN SOMETIMES USUALLY RARELY
TOGETHER ALONE AGAIN TODAY TONIGHT SOON LATER EARLIER ALREADY STILL ONCE TWICE
""")

SPORTS = _words("""
FOOTBALL TENNIS CHESS GOLF CRICKET RUGBY HOCKEY BASEBALL BASKETBALL VOLLEYBALL BADMINTON
CARDS DARTS SNOOKER POOL BOWLING
""")

ACTIVITIES = _words("""
SWIMMING RUNNING CYCLING FISHING SAILING SKIING HIKING CLIMBING DANCING SINGING PAINTING
READING COOKING GARDENING KNITTING SHOPPING CAMPING SKATING JOGGING DRAWING
""")

SUBJECTS = _words("""
MATHS HISTORY GEOGRAPHY SCIENCE MUSIC ART BIOLOGY CHEMISTRY PHYSICS FRENCH SPANISH GERMAN
LATIN ENGLISH ECONOMICS LAW MEDICINE PHILOSOPHY
""")

WEATHER = _words("""
SUNNY RAINY CLOUDY WINDY FOGGY STORMY SNOWY FREEZING HOT WARM COLD MILD WET DRY CLEAR
""")

DAYS = _words("MONDAY TUESDAY WEDNESDAY THURSDAY FRIDAY SATURDAY SUNDAY")
MONTHS = _words("""
JANUARY FEBRUARY MARCH APRIL MAY JUNE JULY AUGUST SEPTEMBER OCTOBER NOVEMBER DECEMBER
""")
SEASONS = _words("SPRING SUMMER AUTUMN WINTER")
PARTS_OF_DAY = _words("MORNING AFTERNOON EVENING NIGHT")
DURATIONS = _words("SECONDS MINUTES HOURS DAYS WEEKS MONTHS YEARS")
DISTANCES = _words("MILES KILOMETRES METRES STEPS YARDS")

PHRASES = _words("""
GOOD_MORNING GOOD_AFTERNOON GOOD_EVENING GOOD_NIGHT HELLO HI THANK_YOU THANKS_A_LOT
THANK_YOU_VERY_MUCH YOU'RE_WELCOME EXCUSE_ME SORRY I'M_SORRY NO_PROBLEM SEE_YOU_LATER
SEE_YOU_SOON SEE_YOU_TOMORROW TAKE_CARE HAVE_A_NICE_DAY WELL_DONE GOOD_LUCK NEVER_MIND
OF_COURSE NOT_AT_ALL HOW_ARE_YOU NICE_TO_MEET_YOU WELCOME_BACK HAPPY_BIRTHDAY CONGRATULATIONS
CHEERS GOODBYE BYE_FOR_NOW HURRY_UP WATCH_OUT BE_CAREFUL COME_IN SIT_DOWN HOLD_ON
JUST_A_MOMENT WAIT_A_MINUTE I_DON'T_KNOW I'M_NOT_SURE THAT'S_RIGHT THAT'S_FINE IT'S_OKAY
LET'S_GO GO_AHEAD ALL_RIGHT SOUNDS_GOOD WHAT_A_SURPRISE WHAT_A_PITY NO_WAY ME_TOO
HOW_LOVELY SAFE_TRAVELS ENJOY_YOUR_MEAL SLEEP_WELL GET_WELL_SOON
""")

# Verbs by the kind of object they take: "BASE PAST ING S PP" or a regular base form.
_IRREGULAR = {
    "EAT": "EAT ATE EATING EATS EATEN", "BUY": "BUY BOUGHT BUYING BUYS BOUGHT",
    "MAKE": "MAKE MADE MAKING MAKES MADE", "TAKE": "TAKE TOOK TAKING TAKES TAKEN",
    "BRING": "BRING BROUGHT BRINGING BRINGS BROUGHT", "FIND": "FIND FOUND FINDING FINDS FOUND",
    "LOSE": "LOSE LOST LOSING LOSES LOST", "SELL": "SELL SOLD SELLING SELLS SOLD",
    "HOLD": "HOLD HELD HOLDING HOLDS HELD", "KEEP": "KEEP KEPT KEEPING KEEPS KEPT",
    "GIVE": "GIVE GAVE GIVING GIVES GIVEN", "DROP": "DROP DROPPED DROPPING DROPS DROPPED",
    "SEE": "SEE SAW SEEING SEES SEEN", "MEET": "MEET MET MEETING MEETS MET",
    "TELL": "TELL TOLD TELLING TELLS TOLD", "TEACH": "TEACH TAUGHT TEACHING TEACHES TAUGHT",
    "LEAVE": "LEAVE LEFT LEAVING LEAVES LEFT", "FORGET": "FORGET FORGOT FORGETTING FORGETS FORGOTTEN",
    "DRINK": "DRINK DRANK DRINKING DRINKS DRUNK", "STEAL": "STEAL STOLE STEALING STEALS STOLEN",
    "HIDE": "HIDE HID HIDING HIDES HIDDEN", "BREAK": "BREAK BROKE BREAKING BREAKS BROKEN",
    "SEND": "SEND SENT SENDING SENDS SENT", "LEND": "LEND LENT LENDING LENDS LENT",
    "SLEEP": "SLEEP SLEPT SLEEPING SLEEPS SLEPT", "RUN": "RUN RAN RUNNING RUNS RUN",
    "SWIM": "SWIM SWAM SWIMMING SWIMS SWUM", "SING": "SING SANG SINGING SINGS SUNG",
    "SIT": "SIT SAT SITTING SITS SAT", "STAND": "STAND STOOD STANDING STANDS STOOD",
    "FALL": "FALL FELL FALLING FALLS FALLEN", "WIN": "WIN WON WINNING WINS WON",
    "GO": "GO WENT GOING GOES GONE", "COME": "COME CAME COMING COMES COME",
    "DRIVE": "DRIVE DROVE DRIVING DRIVES DRIVEN", "FLY": "FLY FLEW FLYING FLIES FLOWN",
    "RIDE": "RIDE RODE RIDING RIDES RIDDEN", "WRITE": "WRITE WROTE WRITING WRITES WRITTEN",
    "READ": "READ READ READING READS READ", "CHOOSE": "CHOOSE CHOSE CHOOSING CHOOSES CHOSEN",
    "GET": "GET GOT GETTING GETS GOT", "PUT": "PUT PUT PUTTING PUTS PUT",
    "SHUT": "SHUT SHUT SHUTTING SHUTS SHUT", "CUT": "CUT CUT CUTTING CUTS CUT",
    "WEAR": "WEAR WORE WEARING WEARS WORN", "SPEND": "SPEND SPENT SPENDING SPENDS SPENT",
    "FEED": "FEED FED FEEDING FEEDS FED", "CATCH": "CATCH CAUGHT CATCHING CATCHES CAUGHT",
    "SHAKE": "SHAKE SHOOK SHAKING SHAKES SHAKEN", "WAKE": "WAKE WOKE WAKING WAKES WOKEN",
    "SHOP": "SHOP SHOPPED SHOPPING SHOPS SHOPPED", "STOP": "STOP STOPPED STOPPING STOPS STOPPED",
    "PLAN": "PLAN PLANNED PLANNING PLANS PLANNED", "CARRY": "CARRY CARRIED CARRYING CARRIES CARRIED",
    "TRY": "TRY TRIED TRYING TRIES TRIED", "STUDY": "STUDY STUDIED STUDYING STUDIES STUDIED",
    "WORRY": "WORRY WORRIED WORRYING WORRIES WORRIED", "HURRY": "HURRY HURRIED HURRYING HURRIES HURRIED",
    "HUG": "HUG HUGGED HUGGING HUGS HUGGED", "WRAP": "WRAP WRAPPED WRAPPING WRAPS WRAPPED",
    "CRY": "CRY CRIED CRYING CRIES CRIED", "DRAW": "DRAW DREW DRAWING DRAWS DRAWN",
    "BEGIN": "BEGIN BEGAN BEGINNING BEGINS BEGUN", "UNDERSTAND":
        "UNDERSTAND UNDERSTOOD UNDERSTANDING UNDERSTANDS UNDERSTOOD",
}

VERBS = {
    "thing": _words("""
        BUY SELL FIND LOSE CARRY CLEAN FIX PAINT OPEN CLOSE BORROW DROP HOLD KEEP MOVE PACK
        WASH CHECK BRING TAKE GIVE HIDE BREAK SEND LEND CHOOSE WEAR ORDER DELIVER REPAIR
        POLISH WRAP UNPACK RETURN COLLECT PICK_UP PUT_AWAY LOOK_FOR STEAL MEASURE SHUT
    """),
    "food": _words("EAT COOK BUY ORDER SHARE TASTE BAKE PREPARE SERVE CUT FINISH"),
    "drink": _words("DRINK POUR WANT ORDER FINISH HEAT SPILL LIKE"),
    "person": _words("""
        MEET CALL HELP VISIT ASK THANK PHONE TELL INVITE FOLLOW TEACH REMEMBER MISS CHEER
        WAKE FORGET SEE HUG WARN PHOTOGRAPH WAIT_FOR LOOK_AFTER UNDERSTAND
    """),
    "place": _words("VISIT LEAVE REACH CLEAN PAINT PASS EXPLORE PHOTOGRAPH SEARCH FIND"),
    "animal": _words("FEED WATCH CATCH CHASE PHOTOGRAPH WASH TRAIN FOLLOW DRAW FIND"),
    "intr": _words("""
        SLEEP LAUGH SMILE RUN WALK SWIM SING DANCE WORK WAIT REST ARRIVE SHOUT CRY JUMP CLIMB
        COUGH SNEEZE RELAX STUDY WORRY HURRY TRAVEL COMPLAIN LISTEN WHISTLE YAWN SHOP
    """),
}

# Literal words of the slot makers below (articles, time and money phrases, titles).
SLOT_GLUE = _words("""
A AN THE SOME MY YOUR OUR HIS HER THEIR MISTER MISSUS DOCTOR PROFESSOR YESTERDAY TODAY
TOMORROW TONIGHT LATER NOW SOON ON LAST NEXT THIS WEEK MONTH YEAR DAY IN AT AGO EVERY AND
HUNDRED THOUSAND MILLION O'CLOCK HALF PAST QUARTER TO OH CUP GLASS BOTTLE OF POUNDS DOLLARS
EUROS PENCE CENTS
""")

_FORMS = {"base": 0, "past": 1, "ing": 2, "s": 3, "pp": 4}


def _regular_forms(base: str) -> list[str]:
    """BASE PAST ING S PP of a regular verb (multi-word verbs inflect their first word)."""
    head, _, rest = base.partition(" ")
    tail = f" {rest}" if rest else ""
    if head in _IRREGULAR:
        return [f + tail for f in _IRREGULAR[head].split()]
    if head.endswith("E"):
        past, ing = head + "D", head[:-1] + "ING"
    else:
        past, ing = head + "ED", head + "ING"
    s = head + "ES" if head.endswith(("S", "SH", "CH", "X")) else head + "S"
    return [head + tail, past + tail, ing + tail, s + tail, past + tail]


# --- numbers, dates and times as words -------------------------------------------------------------

_ONES = _words("""
ZERO ONE TWO THREE FOUR FIVE SIX SEVEN EIGHT NINE TEN ELEVEN TWELVE THIRTEEN FOURTEEN FIFTEEN
SIXTEEN SEVENTEEN EIGHTEEN NINETEEN
""")
_TENS = _words("ZERO TEN TWENTY THIRTY FORTY FIFTY SIXTY SEVENTY EIGHTY NINETY")
_ORDINAL_ONES = _words("""
ZEROTH FIRST SECOND THIRD FOURTH FIFTH SIXTH SEVENTH EIGHTH NINTH TENTH ELEVENTH TWELFTH
THIRTEENTH FOURTEENTH FIFTEENTH SIXTEENTH SEVENTEENTH EIGHTEENTH NINETEENTH
""")
_ORDINAL_TENS = _words("""
ZEROTH TENTH TWENTIETH THIRTIETH FORTIETH FIFTIETH SIXTIETH SEVENTIETH EIGHTIETH NINETIETH
""")


def number_words(n: int) -> str:
    """0 <= n < 10**9 in words, British style: 342 -> "THREE HUNDRED AND FORTY TWO"."""
    if not 0 <= n < 10**9:
        raise ValueError(f"number_words: {n} is outside 0 .. 999,999,999")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " HUNDRED" + ("" if rest == 0 else " AND " + number_words(rest))
    for size, name in ((10**6, "MILLION"), (1000, "THOUSAND")):
        if n >= size:
            rest = n % size
            joiner = " AND " if 0 < rest < 100 else " "
            return number_words(n // size) + " " + name + ("" if rest == 0 else joiner + number_words(rest))
    raise AssertionError("unreachable")


def ordinal_words(n: int) -> str:
    """1 <= n <= 99 as an ordinal: 23 -> "TWENTY THIRD"."""
    if n < 20:
        return _ORDINAL_ONES[n]
    if n % 10 == 0:
        return _ORDINAL_TENS[n // 10]
    return _TENS[n // 10] + " " + _ORDINAL_ONES[n % 10]


def year_words(year: int) -> str:
    """1900 <= year <= 2099 as usually spoken: 1984 -> "NINETEEN EIGHTY FOUR", 2005 -> "TWO THOUSAND AND FIVE"."""
    century, rest = divmod(year, 100)
    if century == 20 and rest < 10:
        return number_words(year)
    if rest == 0:
        return number_words(century) + " HUNDRED"
    if rest < 10:
        return number_words(century) + " OH " + _ONES[rest]
    return number_words(century) + " " + number_words(rest)


def _clock_time(rng: random.Random) -> str:
    hour, style = rng.randint(1, 12), rng.randrange(7)
    h, nxt = _ONES[hour], _ONES[hour % 12 + 1]
    minute = rng.choice([5, 10, 20, 25])
    return [
        f"{h} O'CLOCK", f"HALF PAST {h}", f"A QUARTER PAST {h}", f"A QUARTER TO {nxt}",
        f"{number_words(minute)} PAST {h}", f"{number_words(minute)} TO {nxt}",
        f"{h} {number_words(rng.randint(10, 59))}",
    ][style]


# --- slots ------------------------------------------------------------------------------------------

_AN_EXCEPTIONS = ("UNI", "USE", "EU", "ONE")


def with_article(phrase: str) -> str:
    """"A" or "AN" before the phrase (by its first letter, with the usual exceptions)."""
    an = phrase[0] in "AEIOU" and not phrase.startswith(_AN_EXCEPTIONS)
    return ("AN " if an else "A ") + phrase


_IRREGULAR_PLURALS = {
    "KNIFE": "KNIVES", "SHELF": "SHELVES", "MOUSE": "MICE", "SHEEP": "SHEEP", "DEER": "DEER",
    "FISH": "FISH", "GOOSE": "GEESE", "WOLF": "WOLVES", "SCISSORS": "SCISSORS", "TOMATO": "TOMATOES",
    "POTATO": "POTATOES", "MANGO": "MANGOES", "PIANO": "PIANOS", "PHOTO": "PHOTOS",
    "CHILD": "CHILDREN", "PERSON": "PEOPLE", "RADIO": "RADIOS", "TACO": "TACOS", "KIWI": "KIWIS",
}


def plural(noun: str) -> str:
    """English plural of a noun or noun phrase (its last word)."""
    head, _, last = noun.rpartition(" ")
    prefix = head + " " if head else ""
    if last in _IRREGULAR_PLURALS:
        return prefix + _IRREGULAR_PLURALS[last]
    if last.endswith(("S", "SH", "CH", "X", "Z")):
        return prefix + last + "ES"
    if last.endswith("Y") and last[-2] not in "AEIOU":
        return prefix + last[:-1] + "IES"
    return prefix + last + "S"


def _either(*makers: Callable[[random.Random], str]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(makers)(rng)


def _pick(words: list[str]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(words)


def _described_thing(rng: random.Random) -> str:
    adjective = rng.choice([[], [rng.choice(ADJECTIVES)], [rng.choice(COLORS)]])
    return " ".join([*adjective, rng.choice(THINGS)])


def _count(rng: random.Random) -> str:
    return number_words(rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 20, rng.randint(2, 99)]))


def _person(rng: random.Random) -> str:
    return rng.choice([
        lambda: rng.choice(FIRST_NAMES),
        lambda: rng.choice(FIRST_NAMES) + " " + rng.choice(SURNAMES),
        lambda: rng.choice(["MY", "YOUR", "OUR", "HIS", "HER", "THEIR"]) + " " + rng.choice(RELATIVES),
        lambda: "THE " + rng.choice(JOBS),
        lambda: rng.choice(["MISTER", "MISSUS", "DOCTOR", "PROFESSOR"]) + " " + rng.choice(SURNAMES),
    ])()


def _food(rng: random.Random) -> str:
    return rng.choice([
        lambda: with_article(rng.choice(FOODS)),
        lambda: _count(rng) + " " + plural(rng.choice(FOODS)),
        lambda: "SOME " + rng.choice(MASS_FOODS + [plural(f) for f in FOODS]),
        lambda: "THE " + rng.choice(MASS_FOODS),
    ])()


def _when(rng: random.Random) -> str:
    return rng.choice([
        lambda: rng.choice(["YESTERDAY", "TODAY", "TOMORROW", "TONIGHT", "LATER", "NOW", "SOON"]),
        lambda: "ON " + rng.choice(DAYS),
        lambda: rng.choice(["LAST", "NEXT", "THIS"]) + " " + rng.choice(DAYS + ["WEEK", "MONTH", "YEAR"]),
        lambda: "IN " + rng.choice(MONTHS + SEASONS),
        lambda: "IN THE " + rng.choice(PARTS_OF_DAY[:3]),
        lambda: "AT " + _clock_time(rng),
        lambda: "ON " + rng.choice(DAYS) + " " + rng.choice(PARTS_OF_DAY),
        lambda: number_words(rng.randint(2, 12)) + " " + rng.choice(DURATIONS[1:]) + " AGO",
        lambda: "EVERY " + rng.choice(DAYS + PARTS_OF_DAY + ["DAY", "WEEK", "SUMMER", "WINTER"]),
    ])()


def _price(rng: random.Random) -> str:
    whole = number_words(rng.choice([rng.randint(2, 99), rng.randint(100, 2000)]))
    unit, small = rng.choice([("POUNDS", "PENCE"), ("DOLLARS", "CENTS"), ("EUROS", "CENTS")])
    return whole + " " + unit + (f" AND {number_words(rng.randint(2, 99))} {small}" if rng.random() < 0.4 else "")


def _date(rng: random.Random) -> str:
    return f"THE {ordinal_words(rng.randint(1, 31))} OF {rng.choice(MONTHS)}"


def _digits(rng: random.Random) -> str:
    return " ".join(rng.choice(_ONES[:10] + ["OH"]) for _ in range(rng.randint(4, 7)))


SLOTS: dict[str, Callable[[random.Random], str]] = {
    "name": _pick(FIRST_NAMES),
    "surname": _pick(SURNAMES),
    "person": _person,
    "relative": _pick(RELATIVES),
    "job": _pick(JOBS),
    "a_job": lambda rng: with_article(rng.choice(JOBS)),
    "city": _pick(CITIES),
    "country": _pick(COUNTRIES),
    "where": _either(_pick(CITIES), _pick(COUNTRIES)),
    "place": _pick(TOWN_PLACES),
    "a_thing": lambda rng: with_article(_described_thing(rng)),
    "the_thing": lambda rng: "THE " + _described_thing(rng),
    "things": lambda rng: _count(rng) + " " + plural(rng.choice(THINGS)),
    "thing": _pick(THINGS),
    "food": _food,
    "drink": lambda rng: rng.choice(["A CUP OF ", "A GLASS OF ", "SOME ", "A BOTTLE OF ", ""]) + rng.choice(DRINKS),
    "animal": _pick(ANIMALS),
    "animals": lambda rng: _count(rng) + " " + plural(rng.choice(ANIMALS)),
    "plural_animal": lambda rng: plural(rng.choice(ANIMALS)),
    "owner": lambda rng: rng.choice(FIRST_NAMES) + "'S",
    "color": _pick(COLORS),
    "adj": _pick(ADJECTIVES),
    "feeling": _pick(FEELINGS),
    "adv": _pick(ADVERBS),
    "sport": _pick(SPORTS),
    "activity": _pick(ACTIVITIES),
    "subject": _pick(SUBJECTS),
    "weather": _pick(WEATHER),
    "number": lambda rng: number_words(rng.choice([rng.randint(0, 99), rng.randint(100, 9999),
                                                   rng.randint(10**4, 10**6)])),
    "ordinal": lambda rng: ordinal_words(rng.randint(1, 31)),
    "year": lambda rng: year_words(rng.randint(1900, 2035)),
    "time": _clock_time,
    "date": _date,
    "day": _pick(DAYS),
    "month": _pick(MONTHS),
    "season": _pick(SEASONS),
    "when": _when,
    "price": _price,
    "duration": lambda rng: _count(rng) + " " + rng.choice(DURATIONS),
    "distance": lambda rng: _count(rng) + " " + rng.choice(DISTANCES),
    "digits": _digits,
    "phrase": _pick(PHRASES),
}
VERB_SLOTS = {f"v_{kind}": verbs for kind, verbs in VERBS.items()}

# --- templates --------------------------------------------------------------------------------------

TRAIN_TEMPLATES = [
    "{person} {v_thing:past} {a_thing} {when}",
    "{name} {v_food:past} {food} AT THE {place}",
    "{person} IS GOING TO {v_person:base} {person} {when}",
    "I THINK {name} LEFT {the_thing} AT THE {place}",
    "{person} {v_intr:past} {adv} IN THE {place}",
    "WE {v_place:past} THE {place} IN {city} {when}",
    "{name} LIVES IN {city} NEAR THE {place}",
    "MY {relative} WORKS AS {a_job} IN {where}",
    "THE {job} SAID THE {thing} WAS TOO {adj}",
    "{phrase} {name}",
    "{phrase} I WILL SEE YOU {when}",
    "{person} WAS {feeling} BECAUSE THE {thing} WAS {adj}",
    "CAN YOU {v_thing:base} {the_thing} FOR ME PLEASE",
    "PLEASE DON'T {v_thing:base} {the_thing}",
    "{name} AND {name} PLAYED {sport} {when}",
    "THEY WENT {activity} IN {country} LAST {season}",
    "THE TRAIN TO {city} LEAVES AT {time}",
    "THE MEETING STARTS AT {time} ON {day}",
    "{person} WAS BORN ON {date} {year}",
    "THIS {thing} COST {price}",
    "IT WAS {weather} IN {city} {when}",
    "{person} HAS {things} IN THE {place}",
    "THERE ARE {animals} ON THE {place}",
    "THE {color} {animal} {v_intr:past} NEAR THE {place}",
    "{person} IS {v_animal:ing} THE {animal} {when}",
    "I HAVE NEVER {v_place:pp} {city} BEFORE",
    "{name} STUDIES {subject} AT THE UNIVERSITY OF {city}",
    "WE NEED {food} AND {drink} FOR {day}",
    "{person} ALWAYS {v_drink:s} {drink} IN THE {season}",
    "SHE {v_person:past} {person} AND THEY TALKED ABOUT {subject}",
    "HE WAITED {duration} FOR THE BUS TO {city}",
    "DID YOU {v_thing:base} {the_thing} {when}",
    "WHERE DID {person} PUT {the_thing}",
    "WHY IS THE {thing} SO {adj}",
    "THE {adj} {thing} BELONGS TO {person}",
    "{person} WILL {v_intr:base} {adv} {when}",
    "OUR FLIGHT TO {where} WAS DELAYED BY {duration}",
    "{name} GAVE {person} {a_thing} FOR HER BIRTHDAY",
    "I'D LIKE {food} AND {drink} PLEASE",
    "THE {job} FROM {city} IS VERY {feeling}",
    "{person} SAYS THE {place} OPENS AT {time}",
    "YOUR NUMBER IS {digits}",
    "CALL ME ON {digits} {when}",
    "{name} RAN {distance} {when}",
    "THERE WERE {number} PEOPLE AT THE {place}",
    "IN {year} {person} MOVED TO {where}",
    "WE ARE {v_intr:ing} TO THE {place} {when}",
    "{person} HAD NEVER {v_food:pp} {food} BEFORE",
    "THE {animal} {v_thing:past} {the_thing} AND {v_intr:past}",
    "IT'S {adj} TO {v_place:base} THE {place} IN {month}",
    "{phrase} SAID {person}",
    "MY FAVOURITE {thing} IS {color}",
    "{person} BOUGHT {things} FOR {price}",
    "THE {ordinal} {thing} WAS {adj}",
    "I'M {feeling} BECAUSE {name} {v_intr:past} {when}",
    "THEY WILL {v_person:base} {person} IN {city} ON {date}",
    "LET'S {v_food:base} {food} {when}",
    "{person} COUNTED {animals} ON THE FARM",
    "{name} {surname} IS {a_job} IN {where}",
    "IF YOU {v_thing:base} {the_thing} PLEASE TELL {person}",
    "WHEN DID {person} {v_intr:base} {when}",
    "WHICH {place} DO YOU LIKE BEST",
    "I DO NOT THINK THAT {person} IS {feeling}",
    "THE {animal} IS HIDING UNDER THE {thing}",
    "WE DROVE ALONG THE COAST TO {city} {when}",
    "THEY STAYED IN {where} UNTIL {date}",
    "I CANNOT FIND {the_thing} ANYWHERE",
    "{person} SHOULD {v_person:base} {person} {when}",
    "NOBODY WANTED TO {v_intr:base} {when}",
    "MAYBE WE CAN {v_food:base} {food} AT {time}",
    "THE STORY ABOUT THE {plural_animal} WAS TRUE",
    "BOTH OF THEM WERE {feeling} {when}",
    "WE WALKED AROUND THE {place} IN {season}",
    "THIS {thing} ONCE BELONGED TO {owner} {relative}",
    "{person} PREFERS {drink} IN THE MORNING",
    "WE CAN'T GO WITHOUT {the_thing}",
    "THE {job} DID IT ACCORDING TO PLAN",
    "NO WONDER {person} IS {feeling}",
    "{owner} {thing} IS {color} AND {adj}",
    "{person} HAS JUST {v_thing:pp} {a_thing}",
    "{person} IS {v_food:ing} {food} IN THE KITCHEN",
    "{name} {v_animal:past} {animals} IN THE {place}",
    "WE WENT HOME AFTER THE {sport} MATCH",
    "THE BUS ARRIVES AT {time} {when}",
    "IT WILL BE {weather} IN {city} {when}",
    "{name} KEEPS ASKING ABOUT THE {thing}",
    "I KNOW {person} FROM {where}",
    "{person} SAT NEXT TO {person} {when}",
    "THE PRICE WENT UP {when}",
    "I HAVE NOT SEEN {person} SINCE {month}",
    "PLEASE SEND MY LOVE TO {person}",
    "{person} TEACHES {activity} ON {day}",
    "{person} TOLD US A STORY ABOUT {plural_animal}",
    # Everyday constructions the first list lacked (questions, modals, tenses, conditionals,
    # comparisons, pronoun objects), so that common function words come in many orders.
    "WHAT TIME DOES THE {place} CLOSE ON {day}",
    "HOW MUCH DID YOU PAY FOR {the_thing}",
    "ARE YOU SURE THAT {name} IS COMING {when}",
    "COULD YOU ASK {person} TO CALL ME BACK",
    "WHO LEFT {the_thing} ON THE TABLE",
    "HOW LONG DOES IT TAKE TO GET TO {city}",
    "WHAT DID {person} SAY ABOUT THE {thing}",
    "WOULD YOU LIKE {drink} OR {drink}",
    "DOES {name} STILL LIVE IN {city}",
    "WHERE CAN I BUY {food} AROUND HERE",
    "HOW OFTEN DOES {person} {v_intr:base}",
    "IT IS TOO {weather} TO GO OUT {when}",
    "IT TAKES {duration} TO WALK TO THE {place}",
    "IT LOOKS LIKE {person} FORGOT THE {thing}",
    "I CAN'T BELIEVE IT IS ALREADY {month}",
    "THAT IS NOT WHAT {person} TOLD ME",
    "THIS IS THE BEST {place} IN {city}",
    "THERE WAS NOBODY AT THE {place} {when}",
    "THERE MIGHT BE {animals} IN THE GARDEN",
    "WE HAVE TO {v_place:base} THE {place} BEFORE {time}",
    "YOU SHOULD NEVER {v_thing:base} {the_thing} WITHOUT ASKING",
    "I USED TO {v_intr:base} EVERY DAY WHEN I WAS YOUNG",
    "SHE WANTS TO BECOME {a_job} ONE DAY",
    "HE HAS BEEN {v_intr:ing} ALL MORNING",
    "THEY HAVE ALREADY {v_food:pp} {food}",
    "WE HAD JUST {v_intr:pp} WHEN {person} PHONED",
    "I WILL {v_person:base} YOU AS SOON AS I CAN",
    "{name} WON'T BE ABLE TO COME {when}",
    "YOU MUST {v_thing:base} {the_thing} BEFORE YOU LEAVE",
    "WE COULD {v_place:base} THE {place} IF YOU LIKE",
    "I WOULD RATHER STAY AT HOME {when}",
    "LOOK AT ALL THOSE {plural_animal} OVER THERE",
    "TURN LEFT AT THE {place} AND GO STRAIGHT ON",
    "TAKE THE SECOND STREET ON THE RIGHT AFTER THE {place}",
    "THE {place} IS ON THE OTHER SIDE OF THE ROAD",
    "IS THIS THE WAY TO THE {place}",
    "DON'T FORGET TO {v_person:base} {person} {when}",
    "REMEMBER TO {v_thing:base} {the_thing} BEFORE {day}",
    "I HOPE {name} GETS BETTER SOON",
    "THE DOCTOR SAID I SHOULD {v_intr:base} MORE",
    "MY {relative} HAS A BAD COLD",
    "I FEEL MUCH BETTER THAN I DID {when}",
    "WHAT A {adj} {thing} YOU HAVE",
    "I'M AFRAID THE {place} IS CLOSED {when}",
    "CAN I PAY BY CARD OR DO YOU ONLY TAKE CASH",
    "THAT WILL BE {price} PLEASE",
    "DO YOU HAVE THIS {thing} IN {color}",
    "THE {thing} IS CHEAPER AT THE {place}",
    "I NEED TO GET {food} ON THE WAY HOME",
    "ALL OF MY FRIENDS LIKE {sport}",
    "NONE OF US KNEW WHERE THE {place} WAS",
    "MOST OF THE {plural_animal} WERE ASLEEP",
    "EACH OF THE CHILDREN GOT {a_thing}",
    "ONE OF THE {plural_animal} ESCAPED FROM THE ZOO",
    "THE WEATHER WAS {weather} SO WE STAYED INSIDE",
    "IT RAINED ALL DAY IN {city}",
    "IF I WERE YOU I WOULD {v_person:base} {person}",
    "IF {name} CALLS TELL THEM I AM OUT",
    "UNLESS WE HURRY WE WILL MISS THE TRAIN",
    "WHILE WE WERE {v_intr:ing} {name} {v_food:past} {food}",
    "BEFORE YOU GO PLEASE {v_thing:base} {the_thing}",
    "ALTHOUGH IT WAS {weather} WE WENT FOR A WALK",
    "BECAUSE OF THE {weather} WEATHER THE MATCH WAS CANCELLED",
    "{person} SAID THAT {name} WAS {feeling}",
    "I DIDN'T KNOW THAT YOU COULD {v_intr:base}",
    "DO YOU THINK IT WILL BE {weather} {when}",
    "WE ARE GOING TO NEED {things}",
    "{person} HAS BEEN WORKING AT THE {place} FOR {duration}",
    "HOW MANY {plural_animal} DID YOU SEE",
    "THERE ARE ONLY {number} TICKETS LEFT",
    "THE SHOP ON THE CORNER SELLS {food}",
    "HE FELT {feeling} AND COULD NOT SLEEP",
    "SHE ASKED ME WHETHER I HAD {v_thing:pp} {the_thing}",
    "WE WERE TOLD TO WAIT OUTSIDE THE {place}",
    "THE {thing} WAS FOUND IN THE {place} {when}",
    "{food} WAS COOKED BY {person}",
    "{the_thing} HAS BEEN BROKEN FOR {duration}",
    "I WISH I HAD {v_thing:pp} {the_thing}",
    "IT DOESN'T MATTER WHAT {person} THINKS",
    "WHAT WOULD YOU DO WITH {price}",
    "LET ME KNOW WHEN YOU GET TO {city}",
    "I'LL CALL YOU WHEN I GET HOME",
    "WE'RE MEETING {person} OUTSIDE THE {place}",
    "THEY'VE JUST MOVED INTO A NEW HOUSE IN {city}",
    "HE'S BEEN {v_intr:ing} SINCE {time}",
    "SHE'D NEVER {v_place:pp} {city} BEFORE",
    "WHAT IS THE NAME OF THE {job} FROM {city}",
    "THE {place} IS ABOUT {distance} FROM HERE",
    "IT ONLY TAKES {duration} BY TRAIN",
    "WE SPENT {price} ON {food}",
    "THE CHILDREN WERE {v_animal:ing} THE {plural_animal} ALL AFTERNOON",
    "ALMOST EVERYONE AT THE {place} WAS {feeling}",
    "NOT EVERYONE LIKES {sport}",
    "SOMEBODY TOOK MY {thing} FROM THE {place}",
    "ANYONE CAN LEARN TO {v_intr:base}",
    "WHOSE {thing} IS THIS",
    "WHOEVER FINDS {the_thing} SHOULD CALL {person}",
    "HOW DID YOU KNOW THAT {name} WAS IN {city}",
    "WHY DON'T WE {v_food:base} {food} TOGETHER",
    "SHALL WE MEET AT THE {place} AT {time}",
    "IT'S BEEN {duration} SINCE I LAST SAW {person}",
    "I HAVEN'T HAD {food} FOR AGES",
    "THERE'S {a_thing} ON THE KITCHEN FLOOR",
    "THE {job} ASKED US TO {v_thing:base} {the_thing}",
    "WE WERE ABOUT TO LEAVE WHEN IT STARTED RAINING",
    "WHAT HAPPENED TO THE {thing} YOU BOUGHT {when}",
    "IT WAS THE {ordinal} TIME {name} HAD {v_place:pp} {city}",
    "{person} DOESN'T LIKE {v_food:ing} {food}",
    "ONCE UPON A TIME THERE WAS {a_job} IN {country}",
    "THE NEWS ABOUT {city} WAS ON THE RADIO",
    "{name} IS OLDER THAN {person}",
    "MY {thing} IS BIGGER THAN YOURS",
    "THIS {thing} IS MUCH MORE {adj} THAN THAT ONE",
    "THE {ordinal} OF {month} WILL BE A {day}",
    "IT IS ALMOST {time} AND {name} IS STILL ASLEEP",
    "WHAT ARE YOU DOING {when}",
    "WHERE ARE YOU GOING ON {day}",
    "WHO IS THE {job} IN THE {place}",
    "HOW IS YOUR {relative} DOING",
    "ARE THERE ANY {plural_animal} IN {country}",
    "WERE YOU AT THE {place} {when}",
    "WAS IT {adj} OR {adj}",
    "WILL YOU BE AT HOME {when}",
    "HAS {person} FINISHED {food} YET",
    "HAD YOU EVER {v_place:pp} {city} BEFORE THAT",
    "CAN'T YOU SEE THAT I AM BUSY",
    "ISN'T IT {adj} TODAY",
    "DIDN'T YOU {v_person:base} {person} {when}",
    "WON'T YOU STAY FOR {drink}",
    "YOU KNOW WHAT I MEAN {name}",
    "I DON'T UNDERSTAND WHY THE {thing} IS {adj}",
    "THAT'S EXACTLY WHAT I WAS GOING TO SAY",
    "IT'S UP TO YOU AND {person}",
    "IT GETS DARK EARLY IN {season}",
    "IT WASN'T MY FAULT THAT THE {thing} BROKE",
    "IT'S A PITY THAT {name} COULDN'T COME",
    "HOW ABOUT {v_food:ing} {food} {when}",
    "I'VE LOST MY {thing} AGAIN",
    "FIRST WE {v_intr:past} AND THEN WE {v_food:past} {food}",
    "AFTERWARDS THEY {v_place:past} THE {place}",
    "EVENTUALLY {person} FOUND THE {thing} UNDER THE BED",
    "SUDDENLY THE {animal} {v_intr:past}",
    "LUCKILY NOBODY WAS HURT AT THE {place}",
    "{name} ISN'T AS {adj} AS {person}",
    "WE ARE NOT ALLOWED TO {v_thing:base} {the_thing} HERE",
    "PLEASE MAKE SURE THE {thing} IS CLEAN",
    "THE {plural_animal} ARE FED TWICE A DAY",
    "HOW FAR IS IT FROM {city} TO {city}",
    "I'M NOT SURE IT WILL FIT IN THE {thing}",
    "I THOUGHT IT WAS {adj}",
    "WE BOUGHT IT IN {city} {when}",
    "CAN YOU GIVE IT BACK TO {person} {when}",
    "PUT IT IN THE {thing} PLEASE",
    "WHAT DO YOU CALL IT IN {country}",
]

TEST_TEMPLATES = [
    "DO YOU KNOW IF {person} {v_thing:past} {the_thing}",
    "AFTER {v_food:ing} {food} {name} {v_intr:past} {adv}",
    "{name} TOLD ME THAT THE {place} IN {city} IS {adj}",
    "IS IT TRUE THAT {person} {v_place:past} {where} {when}",
    "NOBODY {v_person:past} {person} AT THE {place}",
    "BY {time} {person} WILL BE {feeling}",
    "ACCORDING TO {person} THE {thing} IS {color}",
    "{phrase} AND {phrase}",
    "WHEN {person} ARRIVES WE WILL {v_food:base} {food}",
    "IF IT IS {weather} {when} WE WILL GO {activity}",
    "THE PRICE OF {a_thing} IS {price}",
    "{person} PREFERS {sport} TO {activity}",
    "BOTH {name} AND {person} {v_intr:past} {when}",
    "HAVE YOU SEEN {person} {v_animal:ing} {animals}",
    "{person} SHOULD HAVE {v_thing:pp} {the_thing} {when}",
    "ON {date} {person} {v_person:past} {person}",
    "THERE IS {a_thing} UNDER THE {thing} IN THE {place}",
    "{owner} {relative} TEACHES {subject} IN {country}",
    "I WONDER WHY {person} WAS SO {feeling} {when}",
    "SEND IT TO {digits} BEFORE {time}",
    "AROUND {number} {plural_animal} WERE SEEN NEAR {city}",
    "UNTIL {year} THE {place} BELONGED TO {person}",
    "{person} KEEPS {things} NEXT TO THE {thing}",
    "WITHOUT {drink} {person} CANNOT {v_intr:base}",
    "THE {adj} {job} {v_animal:past} THE {color} {animal}",
    "MAYBE {person} IS {v_intr:ing} AT THE {place} {when}",
    "{person} AND I WALKED {distance} ALONG THE {place}",
    "WHICH {thing} DID {person} {v_thing:base} {when}",
]

# --- generation ---------------------------------------------------------------------------------------

_SLOT = re.compile(r"\{(\w+)(?::(\w+))?\}")
_NORMALIZED = re.compile(r"^[A-Z0-9]+(?:'[A-Z0-9]+)*(?: [A-Z0-9]+(?:'[A-Z0-9]+)*)*$")


SPLITS = ("train", "dev", "test")


def templates(split: str, seed: int = 0) -> list[str]:
    """The templates of a split: "test" has TEST_TEMPLATES, "dev" the training templates that
    dev_templates(seed) holds out, "train" the rest of TRAIN_TEMPLATES."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    if split == "test":
        return TEST_TEMPLATES
    held = set(dev_templates(seed))
    return [t for t in TRAIN_TEMPLATES if (t in held) == (split == "dev")]


def slot_kinds(template: str) -> set[str]:
    """Slot kinds a template uses, verbs with their form: {"person", "v_thing:past", ...}."""
    kinds = set()
    for m in _SLOT.finditer(template):
        kind, form = m.group(1), m.group(2)
        kinds.add(f"{kind}:{form or 'base'}" if kind in VERB_SLOTS else kind)
    return kinds


def fill(template: str, rng: random.Random) -> str:
    """One sentence from a template, each slot drawn independently."""
    def draw(m: re.Match[str]) -> str:
        kind, form = m.group(1), m.group(2)
        if kind in VERB_SLOTS:
            return _regular_forms(rng.choice(VERB_SLOTS[kind]))[_FORMS[form or "base"]]
        return SLOTS[kind](rng)
    return _SLOT.sub(draw, template)


def is_normalized(sentence: str) -> bool:
    """True when the sentence follows the toolkit's normalized form (upper-case, single spaces)."""
    return bool(_NORMALIZED.match(sentence))


class _DeckRandom(random.Random):
    """random.Random whose choice() deals strings (words, templates) from a shuffled deck per list.

    Every word of a list comes up once before any comes up twice, so that a few thousand
    sentences cover the whole vocabulary evenly. Other sequences (makers, numbers) are drawn as
    usual.
    """

    def __init__(self, seed: str) -> None:
        super().__init__(seed)
        self._decks: dict[tuple[str, ...], list[str]] = {}

    def choice(self, seq: Sequence[Any]) -> Any:
        if not seq or not isinstance(seq[0], str):
            return super().choice(seq)
        key = tuple(seq)
        deck = self._decks.setdefault(key, [])
        if not deck:
            deck.extend(key)
            self.shuffle(deck)
        return deck.pop()


def iter_sentences(split: str, seed: int) -> Iterator[str]:
    """Endless stream of distinct sentences of a split's templates, deterministic given (split,
    seed), without the words the split must not hear (`excluded_words`): a draw that has one is
    dropped."""
    rng = _DeckRandom(f"synth-text:{split}:{seed}")
    pool, seen, excluded = templates(split, seed), set(), excluded_words(split, seed)
    while True:
        sentence = fill(rng.choice(pool), rng)
        if sentence not in seen and excluded.isdisjoint(sentence.split()):
            seen.add(sentence)
            yield sentence


def make_sentences(n: int, split: str = "train", seed: int = 0) -> list[str]:
    """n distinct normalized sentences from the split's templates.

    Deterministic given (split, seed), independent of PYTHONHASHSEED, and prefix-stable:
    make_sentences(n + k, ...)[:n] == make_sentences(n, ...).
    """
    stream = iter_sentences(split, seed)
    return [next(stream) for _ in range(n)]


# --- three worlds: dev templates held out of training, words heard only in dev or only in test ------
#
# Train, dev and test share no template: dev_templates(seed) takes DEV_TEMPLATE_COUNT training
# templates out of training, as TEST_TEMPLATES are, so that dev measures new sentence frames the way
# test does and every decoding choice can be made on it. And each of dev and test has its own
# unseen words (unseen_words): open-class words (names, places, things, foods, animals, jobs) that
# no training sentence, spliced or random-word sentence, or LM sentence ever holds, so that the
# open-vocabulary figure measures spelling from sound and the lexicon's cost shows.

DEV_TEMPLATE_COUNT = 28  # as many as TEST_TEMPLATES
UNSEEN_SHARE = 0.15  # of the open-class words (UNSEEN_LISTS), held out for dev, and as many for test


def _literal_runs(template: str) -> set[tuple[str, ...]]:
    """Every run of three literal (non-slot) words of a template."""
    tokens = template.split()
    return {tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2) if not any("{" in t for t in tokens[i:i + 3])}


def _covers(trained: Sequence[str], held: Sequence[str]) -> bool:
    """Every slot kind (verb forms included) and literal word of the held-out templates is used by
    some training template: held-out sets bring new frames, not new slot kinds or frame words."""
    kinds, words = set().union(*map(slot_kinds, trained)), literal_words(trained)
    return all(slot_kinds(t) <= kinds and literal_words([t]) <= words for t in held)


@functools.cache
def _dev_templates(seed: int) -> tuple[str, ...]:
    order = random.Random(f"synth-dev-templates:{seed}").sample(TRAIN_TEMPLATES, len(TRAIN_TEMPLATES))
    held: list[str] = []
    for t in order:
        if len(held) == DEV_TEMPLATE_COUNT:
            break
        rest = [r for r in TRAIN_TEMPLATES if r != t and r not in held]
        runs = set().union(*map(_literal_runs, rest))
        if not _literal_runs(t) & runs and _covers(rest, [*held, t, *TEST_TEMPLATES]):
            held.append(t)
    return tuple(t for t in TRAIN_TEMPLATES if t in set(held))


def dev_templates(seed: int) -> list[str]:
    """DEV_TEMPLATE_COUNT training templates held out for dev, drawn with the seed: each shares no
    run of three literal words with a template left for training, and what is left still covers
    the dev and test templates' slot kinds and literal words (`_covers`). In TRAIN_TEMPLATES order."""
    return list(_dev_templates(seed))


UNSEEN_LISTS = (FIRST_NAMES, SURNAMES, CITIES, COUNTRIES, THINGS, FOODS, ANIMALS, JOBS)


@functools.cache
def _families() -> dict[str, frozenset[str]]:
    """The open-class words that may be held out, each with the words made of it (plural,
    possessive): only single words that nothing else in the generator writes (no other list,
    verb form, template or glue word), so holding one out removes exactly its family. Cached:
    read it, do not change it."""
    made: dict[str, int] = {}
    def count(words: Iterable[str]) -> None:
        for w in words:
            made[w] = made.get(w, 0) + 1
    lists = [FIRST_NAMES, SURNAMES, CITIES, COUNTRIES, TOWN_PLACES, THINGS, FOODS, MASS_FOODS, DRINKS, ANIMALS,
             JOBS, RELATIVES, COLORS, ADJECTIVES, FEELINGS, ADVERBS, SPORTS, ACTIVITIES, SUBJECTS, WEATHER, DAYS,
             MONTHS, SEASONS, PARTS_OF_DAY, DURATIONS, DISTANCES, PHRASES, SLOT_GLUE, _ONES, _TENS, _ORDINAL_ONES,
             _ORDINAL_TENS, [plural(w) for w in THINGS + FOODS + ANIMALS], [n + "'S" for n in FIRST_NAMES],
             [f for verbs in VERBS.values() for v in verbs for f in _regular_forms(v)],
             literal_words(TRAIN_TEMPLATES + TEST_TEMPLATES)]
    for entries in lists:
        count({w for entry in entries for w in entry.split()})
    families = {}
    for entries in UNSEEN_LISTS:
        for w in entries:
            family = {w}
            if entries in (THINGS, FOODS, ANIMALS):
                family.add(plural(w))
            if entries is FIRST_NAMES:
                family.add(w + "'S")
            if " " not in w and all(made.get(f, 0) == 1 for f in family):
                families[w] = frozenset(family)
    return families


def unseen_words(split: str, seed: int) -> frozenset[str]:
    """The words only `split` ("dev" or "test") may hold: UNSEEN_SHARE of the open-class words
    (`_families`) for each, drawn with the seed, disjoint, with their plurals and possessives."""
    if split not in ("dev", "test"):
        raise ValueError(f"unseen words are dev's or test's, not {split!r}")
    families = _families()
    words = random.Random(f"synth-unseen:{seed}").sample(sorted(families), len(families))
    k = round(UNSEEN_SHARE * len(words))
    chosen = words[:k] if split == "dev" else words[k:2 * k]
    return frozenset(f for w in chosen for f in families[w])


def excluded_words(split: str, seed: int) -> frozenset[str]:
    """Words a split never holds: the other held-out splits' unseen words (training: both)."""
    return frozenset().union(*(unseen_words(s, seed) for s in ("dev", "test") if s != split))


SPLICE_RUN = (2, 5)  # words in each run taken from a sentence
SPLICE_LENGTH = (5, 12)  # words in a spliced sentence


def spliced(sentences: Sequence[str], rng: random.Random) -> str:
    """A sentence of SPLICE_LENGTH words joined from runs of SPLICE_RUN words (the last may be
    shorter) cut out of random `sentences`: their words and word pairs, without the frame of any
    template."""
    target = rng.randint(*SPLICE_LENGTH)
    words: list[str] = []
    while len(words) < target:
        source = rng.choice(sentences).split()
        k = min(rng.randint(*SPLICE_RUN), len(source), target - len(words))
        i = rng.randint(0, len(source) - k)
        words += source[i:i + k]
    return " ".join(words)


def splice_some(sentences: Sequence[str], fraction: float, seed: int, avoid: Iterable[str] = ()) -> list[str]:
    """`sentences` with about `fraction` of them (chosen at random) replaced by sentences spliced
    from runs of their words (`spliced`): deterministic given the seed, never a sentence of `avoid`
    nor a repeat.

    Why: a model trained only on template sentences learns them as a language model and holds on
    to them when a sentence follows a frame it never heard (the new frames, more than the new
    accents, made the test errors of the recipe's first model: recipes/README.md). Spliced
    sentences keep the vocabulary and local word order but no whole frame.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the spliced fraction must be within [0, 1], not {fraction}")
    rng = random.Random(f"synth-splice:{seed}")
    out = list(sentences)
    seen = set(out) | set(avoid)
    for i in range(len(out)):
        if rng.random() >= fraction:
            continue
        for _ in range(100):  # a repeat is rare; give up on this one after 100 draws
            s = spliced(sentences, rng)
            if s not in seen:
                seen.add(s)
                out[i] = s
                break
    return out


def random_words_some(sentences: Sequence[str], fraction: float, seed: int) -> list[str]:
    """`sentences` with about `fraction` of them (chosen at random) replaced by SPLICE_LENGTH
    words drawn uniformly from the training vocabulary (without the words held out for dev and
    test): deterministic given the seed.

    Why: spliced sentences still keep the training templates' word pairs inside their runs, and the
    decoder learns those pairs as a language model; the test frames put common words in pairs the
    training text never has (IF IT, IT IS, WE WILL). Random-word sentences teach it that any word
    may follow any other. See synthesize.RANDOM_WORDS for the measurements.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the random-word fraction must be within [0, 1], not {fraction}")
    rng, words = random.Random(f"synth-salad:{seed}"), sorted(vocabulary() - excluded_words("train", seed))
    out = []
    for sentence in sentences:
        if rng.random() < fraction:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(*SPLICE_LENGTH)))
        out.append(sentence)
    return out


def literal_words(templates: Iterable[str]) -> set[str]:
    """The literal words of templates (the words not drawn from a slot)."""
    return {w for t in templates for w in _SLOT.sub(" ", t).split()}


def template_words(split: str) -> set[str]:
    """The literal words of a split's templates."""
    return literal_words(templates(split))


def slot_words() -> set[str]:
    """Every word a slot can produce: the word lists, their inflections and the slots' glue words."""
    lists = [FIRST_NAMES, SURNAMES, CITIES, COUNTRIES, TOWN_PLACES, THINGS, FOODS, MASS_FOODS,
             DRINKS, ANIMALS, JOBS, RELATIVES, COLORS, ADJECTIVES, FEELINGS, ADVERBS, SPORTS,
             ACTIVITIES, SUBJECTS, WEATHER, DAYS, MONTHS, SEASONS, PARTS_OF_DAY, DURATIONS,
             DISTANCES, PHRASES, SLOT_GLUE, _ONES, _TENS, _ORDINAL_ONES[1:], _ORDINAL_TENS[1:4],
             [plural(w) for w in THINGS + FOODS + ANIMALS], [n + "'S" for n in FIRST_NAMES],
             [f for verbs in VERBS.values() for v in verbs for f in _regular_forms(v)]]
    return {w for entries in lists for entry in entries for w in entry.split()}


def vocabulary() -> set[str]:
    """Every word a sentence of either split can contain (test templates add no word of their own)."""
    return slot_words() | template_words("train") | template_words("test")


# --- a clause grammar: more English word sequences for the word LM -------------------------------------
#
# The templates give the LM their frames only, and the test frames are new by design, so an LM of
# template sentences knows WE WERE but not WE WILL. This grammar writes ordinary clauses from the
# same word lists (tenses, modals, negation, questions, clauses joined or embedded) for the LM's
# text alone; no audio is made from it.

_BE = {"1s": ("AM", "WAS"), "2": ("ARE", "WERE"), "pl": ("ARE", "WERE"), "3s": ("IS", "WAS")}
_PRONOUNS = (("I", "1s"), ("YOU", "2"), ("WE", "pl"), ("THEY", "pl"), ("HE", "3s"), ("SHE", "3s"),
             ("IT", "3s"))
_MODALS = ("CAN", "COULD", "SHOULD", "MUST", "MIGHT", "WOULD", "MAY", "WILL")
_JOINERS = ("AND", "SO", "OR", "BECAUSE", "WHEN", "IF", "BEFORE", "AFTER", "WHILE", "UNTIL",
            "ALTHOUGH", "AS SOON AS")
_FRAMES = ("I THINK", "I KNOW THAT", "I HOPE", "I AM SURE THAT", "WE KNOW THAT", "THEY SAID THAT",
           "SHE SAID THAT", "HE TOLD ME THAT", "IT IS TRUE THAT", "I WONDER IF", "DID YOU KNOW THAT",
           "MAYBE", "PERHAPS", "OF COURSE", "I REMEMBER THAT", "I FORGOT THAT")
_WH = ("WHERE", "WHEN", "WHY", "HOW")


def _subject(rng: random.Random) -> tuple[str, str]:
    """A subject and its agreement: "1s", "2", "pl" or "3s"."""
    r = rng.random()
    if r < 0.55:
        return rng.choice(_PRONOUNS)
    if r < 0.85:
        return _person(rng), "3s"
    if r < 0.92:
        return "THE " + rng.choice(ANIMALS + JOBS), "3s"
    return rng.choice(FIRST_NAMES) + " AND " + rng.choice(["I", *FIRST_NAMES]), "pl"


_OBJECTS: dict[str, Callable[[random.Random], str]] = {
    "thing": _either(SLOTS["the_thing"], SLOTS["a_thing"], SLOTS["things"], lambda rng: rng.choice(["IT", "THEM"])),
    "food": _either(_food, lambda rng: "IT"),
    "drink": SLOTS["drink"],
    "person": _either(_person, lambda rng: rng.choice(["ME", "YOU", "HER", "US", "THEM"])),
    "place": _either(lambda rng: "THE " + rng.choice(TOWN_PLACES), _pick(CITIES), lambda rng: "IT"),
    "animal": _either(lambda rng: "THE " + rng.choice(ANIMALS), SLOTS["animals"], lambda rng: "IT"),
    "intr": lambda rng: "",
}


def _adjunct(rng: random.Random) -> str:
    return rng.choice([
        lambda: "", lambda: "", lambda: _when(rng), lambda: rng.choice(ADVERBS),
        lambda: "AT THE " + rng.choice(TOWN_PLACES), lambda: "IN " + rng.choice(CITIES + COUNTRIES),
        lambda: "WITH " + _person(rng), lambda: "FOR " + SLOTS["duration"](rng),
        lambda: "BEFORE " + _clock_time(rng), lambda: "AFTER " + rng.choice(["LUNCH", "DINNER", "WORK", "SCHOOL"]),
    ])()


def _predicate(rng: random.Random, agree: str) -> str:
    """A verb phrase in one of many tenses and moods, agreeing with the subject."""
    kind = rng.choice(list(VERBS))
    base, past, ing, s, pp = _regular_forms(rng.choice(VERBS[kind]))
    obj = _OBJECTS[kind](rng)
    be_now, be_then = _BE[agree]
    third = agree == "3s"
    verb = rng.choice([
        lambda: s if third else base, lambda: past, lambda: past,
        lambda: "WILL " + base, lambda: "WILL NOT " + base,
        lambda: rng.choice(_MODALS) + rng.choice(["", "", " NOT"]) + " " + base, lambda: "CANNOT " + base,
        lambda: ("HAS " if third else "HAVE ") + rng.choice(["", "", "NOT ", "JUST ", "ALREADY ", "NEVER "]) + pp,
        lambda: "HAD " + pp,
        lambda: rng.choice(["SHOULD", "COULD", "MIGHT", "WOULD", "MUST"]) + rng.choice(["", " NOT"]) + " HAVE " + pp,
        lambda: rng.choice([be_now, be_then]) + rng.choice(["", "", " NOT"]) + " " + ing,
        lambda: rng.choice([be_now, be_then]) + " GOING TO " + base,
        lambda: ("DOES NOT " if third else "DO NOT ") + base, lambda: "DID NOT " + base,
        lambda: rng.choice(["WANTS TO " if third else "WANT TO ", "WANTED TO ", "HAS TO " if third else "HAVE TO ",
                            "HAD TO ", "USED TO ", "LIKES TO " if third else "LIKE TO ", "FORGOT TO ",
                            "WILL HAVE TO ", "IS ABLE TO " if third else "CAN "]) + base,
    ])()
    return " ".join(filter(None, [verb, obj, _adjunct(rng)]))


def _copula(rng: random.Random, agree: str) -> str:
    be_now, be_then = _BE[agree]
    be = rng.choice([be_now, be_then, be_now + " NOT", be_then + " NOT", "WILL BE", "MIGHT BE", "SHOULD BE",
                     "HAS BEEN" if agree == "3s" else "HAVE BEEN", "USED TO BE"])
    rest = rng.choice([
        lambda: rng.choice(FEELINGS),
        lambda: rng.choice(["VERY", "SO", "TOO", "QUITE", "REALLY"]) + " " + rng.choice(FEELINGS),
        lambda: rng.choice(ADJECTIVES), lambda: "AT THE " + rng.choice(TOWN_PLACES),
        lambda: "IN " + rng.choice(CITIES + COUNTRIES), lambda: with_article(rng.choice(JOBS)),
    ])()
    return f"{be} {rest} {_adjunct(rng)}".strip()


def _clause(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.1:
        thing = rng.choice([SLOTS["a_thing"], SLOTS["things"], _food])(rng)
        many = not thing.startswith(("A ", "AN ", "SOME "))
        be = rng.choice(["ARE", "WERE"] if many else ["IS", "WAS"]) + rng.choice(["", " NOT"])
        where = rng.choice(["IN THE ", "ON THE ", "UNDER THE ", "NEXT TO THE ", "BEHIND THE "])
        return f"THERE {rng.choice([be, 'WILL BE'])} {thing} {where}{rng.choice(THINGS + TOWN_PLACES)}"
    subject, agree = _subject(rng)
    predicate = _copula(rng, agree) if r < 0.3 else _predicate(rng, agree)
    return f"{subject} {predicate}"


def _question(rng: random.Random) -> str:
    subject, agree = _subject(rng)
    kind = rng.choice(list(VERBS))
    base, past, ing, s, pp = _regular_forms(rng.choice(VERBS[kind]))
    obj = _OBJECTS[kind](rng)
    third = agree == "3s"
    be_now, be_then = _BE[agree]
    aux, verb = rng.choice([
        ("DOES" if third else "DO", base), ("DID", base), (rng.choice(_MODALS), base),
        ("HAS" if third else "HAVE", pp), (rng.choice([be_now, be_then]), ing),
    ])
    wh = rng.choice(["", "", *_WH])
    return " ".join(filter(None, [wh, aux, subject, verb, obj, _adjunct(rng) if not wh else ""]))


def clause_sentence(rng: random.Random) -> str:
    """One sentence of the clause grammar (may be too long or hold a test frame: see `clauses`)."""
    r = rng.random()
    if r < 0.4:
        return _clause(rng)
    if r < 0.6:
        return f"{_clause(rng)} {rng.choice(_JOINERS)} {_clause(rng)}"
    if r < 0.7:
        return f"{rng.choice(['IF', 'WHEN', 'AFTER', 'BEFORE', 'BECAUSE', 'WHILE'])} {_clause(rng)} {_clause(rng)}"
    if r < 0.85:
        return _question(rng)
    return f"{rng.choice(_FRAMES)} {_clause(rng)}"


def clauses(n: int, seed: int = 0, max_words: int = 16) -> list[str]:
    """n distinct sentences of the clause grammar, deterministic given the seed: each of the
    training vocabulary (none of the words held out for dev or test), at most max_words long (a
    draw that is not is drawn again). The grammar is written from the word lists alone: it knows
    nothing of the dev or test templates."""
    rng = _DeckRandom(f"synth-clauses:{seed}")
    vocab = vocabulary() - excluded_words("train", seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        sentence = " ".join(clause_sentence(rng).split())
        words = sentence.split()
        if len(words) > max_words or sentence in seen or not vocab.issuperset(words):
            continue
        seen.add(sentence)
        out.append(sentence)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=10, help="number of sentences")
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for i, sentence in enumerate(make_sentences(args.num, args.split, args.seed)):
        print(f"{args.split}-{i:06d} {sentence}")


if __name__ == "__main__":
    main()

"""Generate examples/data/corpus.txt: a small, seeded, plain-English corpus for examples/train_dsa.py.

The text is an imaginary gazetteer ("The Almanac of the Lowland Provinces"): hand-written prose passages
interleaved with encyclopedia entries on towns, rivers, animals and people, plus short fables, all built from
fixed templates and word lists with a seeded random generator. Nothing is downloaded; rerunning the script
reproduces the shipped file byte for byte:

    python examples/data/make_corpus.py            # writes examples/data/corpus.txt
"""

from __future__ import annotations

import argparse
import random
import textwrap
from pathlib import Path

TARGET_BYTES = 150_000

PROSE = [
    "The lowland provinces lie between the grey northern hills and the long flat shore of the southern sea. "
    "Most of the country is farmland, cut into narrow fields by hedges, ditches and slow brown rivers. In spring "
    "the water rises and covers the lowest meadows, and in summer it falls again and leaves behind a soft dark "
    "soil that the farmers prize above everything else. Travellers who come from the hills often say that the "
    "land is dull, because a man can stand on a dyke and see three church towers and a windmill without turning "
    "his head. Those who stay for a season usually change their minds.",
    "Every town in the provinces keeps a book of records, and most of what follows was copied from those books. "
    "The clerks who kept them were careful people but not always patient ones, so the entries are short. They "
    "tell us when a bridge was built and when it fell down, how many sheep were counted at the autumn fair, and "
    "which families quarrelled over the mill. They rarely tell us what anyone thought or felt, and where they do, "
    "the remark is usually written in the margin in a smaller hand.",
    "Weather rules the year. The winters are wet rather than cold, and snow is rare enough that children talk "
    "about it for months afterwards. The wind comes from the west and carries the smell of salt a long way "
    "inland. In the old days the wind also turned the mills that drained the fields, and a farmer who lost his "
    "mill in a storm could lose his harvest in the same week. Many of those mills still stand, although most of "
    "them have not turned a sail in living memory.",
    "The roads of the provinces were poor until the last century. Goods went by water whenever they could: "
    "barges carried grain, peat, bricks and cheese along the rivers and canals, and the towns grew up where two "
    "waterways met or where a river could be crossed. Even now the oldest streets of a town tend to follow the "
    "line of a vanished quay, and the largest houses face the water rather than the road.",
    "It is said in the provinces that a good neighbour is worth more than a good wall. The saying is older than "
    "anyone can remember, and it was meant quite practically. When the river broke through a dyke, the whole "
    "parish turned out with spades and sacks of sand, and a family that had refused to help its neighbours in "
    "one flood could not expect much help in the next.",
    "The people are fond of plain food: bread, butter, cheese, smoked fish, pea soup in winter and berries in "
    "summer. A feast day means roast goose or a leg of mutton, followed by a heavy cake made with honey and "
    "dried fruit. Beer is brewed in almost every village, and each village is certain that its own beer is the "
    "best in the country and that the beer of the next village is hardly fit for pigs.",
    "Schools came late to the countryside. For a long time the only teacher in a village was the sexton, who "
    "taught the children their letters in the church porch on winter afternoons when there was no work in the "
    "fields. Many of the records in this book were written by men who had learned to write in exactly that way, "
    "and their spelling shows it.",
    "The sea is both the friend and the enemy of the provinces. It brought the fishing fleets their living and "
    "the merchants their fortunes, but it also took back whole villages in a single night. On the old maps the "
    "coast is drawn further out than it lies today, and the names of drowned parishes are still written on the "
    "charts that the fishermen use.",
]

SYLLABLES_A = ["Ash", "Bram", "Cal", "Dun", "El", "Fen", "Gar", "Hol", "Ives", "Kel", "Lang", "Mar", "Nor", "Ost",
               "Pell", "Quen", "Ros", "Sel", "Thorn", "Ul", "Vere", "Wick", "Yar", "Brig", "Stan", "Ald", "Corn"]
SYLLABLES_B = ["ford", "ham", "ley", "mere", "wick", "stead", "bury", "holm", "by", "thorpe", "marsh", "dale",
               "field", "brook", "well", "ton", "worth", "haven", "moor", "bridge"]
RIVER_NAMES = ["Aven", "Brede", "Colne", "Dell", "Esk", "Frome", "Gade", "Hale", "Isel", "Leam", "Mole", "Nene",
               "Ouse", "Perry", "Rother", "Swale", "Tame", "Ure", "Wey", "Yare", "Lune", "Kenn", "Dart", "Otter"]
FIRST_NAMES = ["Anna", "Bartholomew", "Clara", "Dirk", "Elsa", "Frederick", "Greta", "Hendrik", "Ida", "Jacob",
               "Katrin", "Lucas", "Margaret", "Nicholas", "Olga", "Peter", "Rosa", "Simon", "Theodora", "Walter",
               "Agnes", "Bernard", "Cecily", "Edmund", "Harriet", "Isaac", "Julia", "Martin", "Sophia", "Thomas"]
SURNAMES = ["Aldridge", "Barlow", "Cotter", "Dekker", "Elwood", "Fairweather", "Gilchrist", "Hartley", "Ingram",
            "Janssen", "Kettle", "Lowell", "Merriman", "Norcott", "Oakes", "Pennick", "Reeve", "Sayer", "Tolley",
            "Underhill", "Vance", "Whitlock", "Marsh", "Miller", "Thatcher", "Fisher", "Cooper", "Weaver"]
REGIONS = ["the northern hills", "the western fens", "the southern coast", "the eastern heath",
           "the middle valley", "the river country", "the old forest", "the salt marshes"]
INDUSTRIES = ["cheese making", "weaving", "brick making", "boat building", "rope making", "brewing", "milling",
              "peat cutting", "fishing", "sheep farming", "pottery", "tanning", "basket making", "barley growing"]
LANDMARKS = ["a stone bridge of seven arches", "a tall brick windmill", "a church with a leaning tower",
             "a market hall on wooden pillars", "the ruins of a small castle", "a lock keeper's cottage",
             "an old horse fair ground", "a covered well in the square", "a row of almshouses",
             "a lighthouse on the dunes", "a wooden toll house", "a chapel built by the guild of weavers"]
GOODS = ["grain", "wool", "cheese", "bricks", "peat", "salt fish", "timber", "barley", "rope", "cloth", "eggs"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ANIMALS = [
    ("heron", "bird", "the edges of ditches and slow rivers", "fish and frogs", "long legs and a grey back"),
    ("otter", "mammal", "clean rivers with steep banks", "fish and crayfish", "a sleek brown coat"),
    ("marsh harrier", "bird", "reed beds and wet meadows", "small birds and voles", "long narrow wings"),
    ("water vole", "mammal", "grassy banks of canals", "grasses and roots", "a round face and small ears"),
    ("lapwing", "bird", "wet fields and pastures", "worms and beetles", "a thin crest on its head"),
    ("eel", "fish", "rivers, ditches and the open sea", "worms, snails and small fish", "a long slippery body"),
    ("hare", "mammal", "open fields and dykes", "grass and young crops", "long ears with black tips"),
    ("stork", "bird", "villages near wet grassland", "frogs, mice and insects", "a red bill and white feathers"),
    ("badger", "mammal", "woods at the edge of farmland", "worms, roots and fruit", "a striped black and white face"),
    ("pike", "fish", "still water among weeds", "other fish and young ducks", "a long jaw full of teeth"),
    ("barn owl", "bird", "old barns and church towers", "mice and shrews", "a pale heart-shaped face"),
    ("natterjack toad", "amphibian", "sandy dunes near the sea", "beetles and ants", "a yellow stripe on its back"),
]
PROFESSIONS = ["miller", "schoolmaster", "lock keeper", "surveyor", "painter", "merchant", "shipwright",
               "physician", "clerk of the dykes", "organist", "printer", "botanist", "mapmaker", "brewer"]
DEEDS = [
    "drew the first accurate map of the river mouth",
    "kept a diary of the weather for forty years",
    "rebuilt the mill after the great storm",
    "founded a school for the children of boatmen",
    "wrote a small book on the birds of the marshes",
    "persuaded the council to raise the sea dyke by two feet",
    "painted the market square in every season of the year",
    "collected the old songs of the barge men",
    "designed a new kind of sluice gate",
    "organised the relief of the town during the flood",
    "planted the avenue of lime trees along the canal",
    "printed the first newspaper in the province",
]
FABLE_CHARACTERS = ["a fox", "a heron", "an old goat", "a young hare", "a crow", "a miller's cat", "a field mouse",
                    "a proud cockerel", "a tired horse", "a clever magpie", "a patient tortoise", "a barge dog"]
FABLE_PROBLEMS = [
    ("the river had frozen and there was nothing to eat", "found a store of grain under the ice"),
    ("the bridge had been washed away in the night", "showed the others a safe place to cross"),
    ("the farmer had locked the gate of the orchard", "dug a narrow path beneath the hedge"),
    ("a storm had torn the roof from the barn", "led everyone to the dry loft of the mill"),
    ("the well in the yard had run dry", "remembered a spring at the foot of the dyke"),
    ("the winter was long and the hay was running out", "shared what was left fairly among them"),
]
MORALS = [
    "A friend in need is a friend indeed.",
    "Pride goes before a fall.",
    "Slow and steady wins the race.",
    "Many hands make light work.",
    "Look before you leap.",
    "It is better to share a little than to hoard a lot.",
    "The one who listens learns more than the one who boasts.",
]


def town_name(rng: random.Random) -> str:
    return rng.choice(SYLLABLES_A) + rng.choice(SYLLABLES_B)


def person_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"


def number_words(n: int) -> str:
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    return words[n] if n < len(words) else str(n)


def town_entry(rng: random.Random) -> str:
    name, river, region = town_name(rng), rng.choice(RIVER_NAMES), rng.choice(REGIONS)
    founded = rng.randint(1150, 1720)
    kind, low, high = rng.choice([("market town", 2000, 24000), ("village", 150, 1800), ("river town", 1500, 16000),
                                  ("harbour town", 2500, 30000), ("parish", 300, 3000)])
    population = rng.randrange(low, high, 10)
    industry, industry2 = rng.sample(INDUSTRIES, 2)
    landmark = rng.choice(LANDMARKS)
    settlement = "village" if kind in ("village", "parish") else "town"
    sentences = [
        f"{name} is a {rng.choice(['small', 'quiet', 'busy', 'pleasant', 'old'])} "
        f"{kind} in {region}, on the {rng.choice(['left', 'right', 'north', 'south'])} bank of the river {river}.",
        f"It was first recorded in {founded}, when {rng.choice(['a charter', 'a deed', 'a letter', 'a tax roll'])} "
        f"mentioned {number_words(rng.randint(3, 12))} households and a {rng.choice(['ferry', 'mill', 'chapel'])}.",
        f"The {settlement} has about {population:,} inhabitants, and most of them earn their living from {industry} "
        f"or {industry2}.",
        f"Visitors usually come to see {landmark}, which stands "
        f"{rng.choice(['near the market', 'by the river', 'at the end of the high street', 'outside the old gate'])}.",
    ]
    if rng.random() < 0.6:
        year = founded + rng.randint(20, 300)
        sentences.append(
            f"In {year} {rng.choice(['a great flood', 'a fire', 'a hard winter', 'a cattle plague'])} "
            f"{rng.choice(['destroyed half of the houses', 'ruined the harvest', 'closed the market for a year'])}, "
            f"and the {settlement} was {rng.choice(['slowly rebuilt', 'nearly abandoned', 'saved by its neighbours'])}."
        )
    if rng.random() < 0.7:
        sentences.append(
            f"A fair is held every {rng.choice(MONTHS)}, when farmers bring {rng.choice(GOODS)} and "
            f"{rng.choice(GOODS)} to sell in the square."
        )
    if rng.random() < 0.5:
        sentences.append(
            f"The road to {town_name(rng)} crosses the {river} by {rng.choice(['a ferry', 'a ford', 'a bridge'])} "
            f"{rng.choice(['a mile', 'two miles', 'half a mile', 'three miles'])} below the {settlement}."
        )
    return f"{name}\n\n" + " ".join(sentences)


def river_entry(rng: random.Random) -> str:
    river, length = rng.choice(RIVER_NAMES), rng.randint(12, 160)
    source, mouth = town_name(rng), town_name(rng)
    good1, good2 = rng.sample(GOODS, 2)
    sentences = [
        f"The river {river} rises in {rng.choice(REGIONS)} near {source} and flows "
        f"{rng.choice(['east', 'west', 'south', 'north-east', 'south-west'])} for about {length} miles "
        f"before it joins {rng.choice(['the sea', 'a larger river', 'the great canal', 'an estuary'])} at {mouth}.",
        f"Its water is {rng.choice(['clear and cold', 'brown and slow', 'shallow and quick', 'deep and still'])}, "
        f"and its banks are lined with {rng.choice(['willows', 'reeds', 'alders', 'poplars', 'meadows'])}.",
        f"For centuries barges carried {good1} and {good2} along the {river}, and "
        f"{number_words(rng.randint(2, 9))} locks were built to keep the water deep enough for them.",
    ]
    if rng.random() < 0.6:
        animal = rng.choice(ANIMALS)[0]
        sentences.append(f"The {animal} is often seen along its lower reaches, especially in the early morning.")
    if rng.random() < 0.5:
        sentences.append(
            f"The river floods {rng.choice(['almost every winter', 'once in a generation', 'after heavy rain'])}, "
            f"and the old people of {mouth} still measure the years by the great floods."
        )
    return f"River {river}\n\n" + " ".join(sentences)


def animal_entry(rng: random.Random) -> str:
    name, kind, habitat, diet, feature = rng.choice(ANIMALS)
    article = "An" if name[0] in "aeiou" else "A"
    sentences = [
        f"The {name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind} of {habitat}.",
        f"It is easily recognised by {feature}, and it feeds mainly on {diet}.",
        f"{article} {name} is most active {rng.choice(['at dawn', 'at dusk', 'at night', 'in the middle of the day'])}"
        f" and {rng.choice(['usually lives alone', 'lives in small family groups', 'gathers in large numbers'])}.",
        f"In the provinces it is {rng.choice(['common', 'rare', 'fairly common', 'becoming scarce'])}, and "
        f"{rng.choice(['farmers', 'fishermen', 'children', 'old people'])} say that "
        f"{rng.choice(['it brings good luck', 'seeing one means rain', 'it knows when a flood is coming'])}.",
    ]
    if rng.random() < 0.5:
        sentences.append(
            f"The young are born in {rng.choice(MONTHS[2:7])} and leave their parents "
            f"{rng.choice(['after a few weeks', 'before the autumn', 'in their second year'])}."
        )
    return f"{name.capitalize()}\n\n" + " ".join(sentences)


def person_entry(rng: random.Random) -> str:
    name, profession, town = person_name(rng), rng.choice(PROFESSIONS), town_name(rng)
    born = rng.randint(1600, 1880)
    died = born + rng.randint(35, 90)
    deed1, deed2 = rng.sample(DEEDS, 2)
    pronoun = "she" if name.split()[0] in {"Anna", "Clara", "Elsa", "Greta", "Ida", "Katrin", "Margaret", "Olga",
                                           "Rosa", "Theodora", "Agnes", "Cecily", "Harriet", "Julia",
                                           "Sophia"} else "he"
    possessive = "her" if pronoun == "she" else "his"
    sentences = [
        f"{name} ({born} to {died}) was a {profession} from {town}.",
        f"As a young {rng.choice(['man', 'apprentice', 'clerk']) if pronoun == 'he' else 'woman'} {pronoun} "
        f"{rng.choice(['worked for an uncle in the city', 'travelled along the coast', 'studied in the capital'])}, "
        f"and {pronoun} returned home in {born + rng.randint(18, 30)}.",
        f"{pronoun.capitalize()} is remembered because {pronoun} {deed1}.",
        f"Later {pronoun} also {deed2}, although this was less well known in {possessive} lifetime.",
    ]
    if rng.random() < 0.5:
        sentences.append(
            f"A {rng.choice(['street', 'school', 'bridge', 'small park'])} in {town} is named after "
            f"{'her' if pronoun == 'she' else 'him'}."
        )
    return f"{name}\n\n" + " ".join(sentences)


def fable(rng: random.Random) -> str:
    hero, other = rng.sample(FABLE_CHARACTERS, 2)
    hero_noun, other_noun = hero.split(" ", 1)[1], other.split(" ", 1)[1]
    problem, solution = rng.choice(FABLE_PROBLEMS)
    season = rng.choice(["one winter", "one autumn", "late one spring", "on a wet summer evening"])
    sentences = [
        f"{season.capitalize()}, {hero} and {other} lived near the same farm, and {problem}.",
        f"The {other_noun} {rng.choice(['laughed', 'boasted', 'complained', 'sulked'])} and said that nothing "
        f"could be done, and that it was every animal for itself.",
        f"But the {hero_noun} {rng.choice(['thought for a long time', 'walked along the dyke', 'asked the old owl'])}"
        f", and in the end it {solution}.",
        f"When the trouble was over, the {other_noun} was ashamed and thanked the {hero_noun} for "
        f"{rng.choice(['its help', 'its kindness', 'its patience'])}.",
        rng.choice(MORALS),
    ]
    return f"A fable of the {hero_noun} and the {other_noun}\n\n" + " ".join(sentences)


def build_corpus(seed: int = 1234, target_bytes: int = TARGET_BYTES) -> str:
    rng = random.Random(seed)
    makers = [town_entry, town_entry, river_entry, animal_entry, person_entry, fable]
    parts = ["THE ALMANAC OF THE LOWLAND PROVINCES"]
    size, prose_next = len(parts[0]), 0
    while size < target_bytes:
        if rng.random() < 0.08:
            text = PROSE[prose_next % len(PROSE)]
            prose_next += 1
        else:
            text = rng.choice(makers)(rng)
        paragraph = "\n".join(textwrap.fill(block, width=100) for block in text.split("\n"))
        parts.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("corpus.txt"))
    args = parser.parse_args(argv)
    text = build_corpus(args.seed)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {args.out} ({len(text):,} bytes)")


if __name__ == "__main__":
    main()

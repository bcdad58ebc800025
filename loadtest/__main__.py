from loadtest.cli import main

main()

from pilldrops.cli.main import main

main()
